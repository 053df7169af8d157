"""pk_jax.grouped_matmul on CPU (the reference path) and its CUDA lowering."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, ffi_attr, rel_err
from helpers.grouped_matmul_cases import CASES, dense, dense_grads, inputs
from pk_jax.ops.grouped_matmul import primitive as prim


@pytest.mark.parametrize("m,k,n,sizes", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_values_and_gradients(rng, m, k, n, sizes, dtype):
    x, w, t = inputs(rng, m, k, n, len(sizes), dtype)
    s = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(pk_jax.grouped_matmul)(x, w, s)
    want = dense(x, w, sizes)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5  # bf16 results: 2^-9 rounding each
    assert rel_err(out, want) < tol
    used = sum(min(max(v, 0), m) for v in sizes)  # rows past the sum are exactly zero
    assert not np.any(np.asarray(out, np.float32)[min(used, m):])
    loss = lambda x, w: jnp.sum(pk_jax.grouped_matmul(x, w, s).astype(jnp.float32) * t)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    want_dx, want_dw = dense_grads(x, w, sizes, t)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert rel_err(dx, want_dx) < tol and rel_err(dw, want_dw) < tol
    for g, v in enumerate(sizes):  # a group with no rows has a zero gradient
        if v <= 0:
            assert not np.any(np.asarray(dw[g], np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_inside_shard_map_each_device_its_groups(rng, sharding_mode, dtype):
    """Values and both gradients per device: each device's weight gradient
    is its own rows' (never summed over the axis)."""
    mesh = cpu_mesh((4,), ("ep",))
    m, k, n, g = 32, 16, 8, 3
    x, w, _ = inputs(rng, 4 * m, k, n, 4 * g, dtype)
    t = np.asarray(rng.standard_normal((4 * m, n)).astype(jnp.bfloat16), np.float32)
    sizes = rng.integers(0, 14, (4 * g,)).astype(np.int32)
    put = lambda a, spec=P("ep"): jax.device_put(a, NamedSharding(mesh, spec))
    f = jax.shard_map(pk_jax.grouped_matmul, mesh=mesh, in_specs=(P("ep"),) * 3,
                      out_specs=P("ep"))
    args = put(x), put(w), put(sizes)
    out = np.asarray(jax.jit(f)(*args))
    loss = lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32) * put(t))
    dx, dw = (np.asarray(a, np.float64) for a in jax.jit(jax.grad(loss, (0, 1)))(*args))
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for d in range(4):
        r, e = slice(d * m, (d + 1) * m), slice(d * g, (d + 1) * g)
        want_dx, want_dw = dense_grads(x[r], w[e], sizes[e], t[r])
        assert rel_err(out[r], dense(x[r], w[e], sizes[e])) < tol
        assert rel_err(dx[r], want_dx) < tol and rel_err(dw[e], want_dw) < tol, d


@pytest.mark.parametrize("call,match", [
    (lambda x, w, s: pk_jax.grouped_matmul(x[0], w, s), "lhs \\[M, K\\] and rhs"),
    (lambda x, w, s: pk_jax.grouped_matmul(x, w[:, :8], s), "lhs \\[M, K\\] and rhs"),
    (lambda x, w, s: pk_jax.grouped_matmul(x, w, s[:1]), "group_sizes must be"),
    (lambda x, w, s: pk_jax.grouped_matmul(x, w, s.astype(jnp.float32)), "integers"),
    (lambda x, w, s: pk_jax.grouped_matmul(x, w.astype(jnp.float16), s), "one floating dtype"),
    (lambda x, w, s: pk_jax.grouped_matmul(x, w, s, mechanism="fast"), "mechanism must be"),
    (lambda x, w, s: pk_jax.grouped_matmul(x[:, :12], w[:, :12], s, mechanism="kernel"),
     "multiples of 8"),
    (lambda x, w, s: pk_jax.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), s,
                                           mechanism="kernel"), "bfloat16 or float16"),
])
def test_bad_input_is_named(call, match):
    x = jnp.ones((16, 16), jnp.bfloat16)
    w = jnp.ones((2, 16, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        call(x, w, jnp.array([8, 8], jnp.int32))


def test_kernel_problem_limits():
    x = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)
    assert prim.kernel_problem(x, jax.ShapeDtypeStruct((2, 16, 8), jnp.bfloat16)) is None
    big = jax.ShapeDtypeStruct((prim.MAX_GROUPS + 1, 16, 8), jnp.bfloat16)
    assert "groups" in prim.kernel_problem(x, big)


def _calls(hlo):
    return re.findall(r"custom_call @pk_grouped_matmul\((.*?)\{(.*?)\}, operand_layouts", hlo)


def test_cuda_lowering_forward_and_both_gradients_are_kernel_calls(cuda_lowering):
    m, k, n, g = 256, 64, 32, 4
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32))
    loss = lambda x, w, s: jnp.sum(pk_jax.grouped_matmul(x, w, s).astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = _calls(hlo)
    assert sorted(ffi_attr(attrs, "kind") for _, attrs in calls) == ["0", "1", "2"]
    assert "ragged_dot" not in hlo  # no XLA grouped GEMM left
    assert f"tensor<{prim.scratch_bytes(g)}xui8>" in hlo  # the scratch result
    # The check can fail: mechanism="xla" lowers to XLA's ragged dot.
    xla = jax.jit(lambda x, w, s: pk_jax.grouped_matmul(x, w, s, mechanism="xla")).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    assert not _calls(xla) and "ragged_dot" in xla


def test_cuda_lowering_takes_xla_for_shapes_the_kernel_does_not(cuda_lowering):
    args = (jax.ShapeDtypeStruct((64, 12), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 12, 8), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = jax.jit(pk_jax.grouped_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert not _calls(hlo) and "ragged_dot" in hlo


def test_forced_kernel_without_the_extension_says_why(monkeypatch):
    from pk_jax import runtime
    monkeypatch.setattr(runtime, "available", lambda: False)
    args = (jax.ShapeDtypeStruct((64, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 16, 8), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32))
    f = jax.jit(lambda x, w, s: pk_jax.grouped_matmul(x, w, s, mechanism="kernel"))
    with pytest.raises(ValueError, match="mechanism='kernel'.*native kernels are unavailable"):
        f.trace(*args).lower(lowering_platforms=("cuda",))


def test_float32_result_and_its_gradients(rng):
    m, k, n, sizes = CASES[2]
    x, w, t = inputs(rng, m, k, n, len(sizes), jnp.bfloat16)
    s = jnp.asarray(sizes, jnp.int32)
    f = lambda x, w: pk_jax.grouped_matmul(x, w, s, preferred_element_type=jnp.float32)
    out = jax.jit(f)(x, w)
    assert out.dtype == jnp.float32 and rel_err(out, dense(x, w, sizes)) < 1e-5
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * t), (0, 1)))(x, w)
    want_dx, want_dw = dense_grads(x, w, sizes, t)
    assert dx.dtype == jnp.bfloat16 and rel_err(dx, want_dx) < 1e-2
    assert dw.dtype == jnp.bfloat16 and rel_err(dw, want_dw) < 1e-2
    with pytest.raises(ValueError, match="preferred_element_type"):
        pk_jax.grouped_matmul(x, w, s, preferred_element_type=jnp.float16)


def test_cuda_lowering_float32_result(cuda_lowering):
    args = (jax.ShapeDtypeStruct((256, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    f = lambda x, w, s: pk_jax.grouped_matmul(x, w, s, preferred_element_type=jnp.float32)
    hlo = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = _calls(hlo)
    assert "tensor<256x32xf32>" in hlo and ffi_attr(call[1], "kind") == "0"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])  # the kernel path, the reference
def test_int64_group_sizes_do_not_wrap(rng, dtype):
    """With x64 on, a group size of 2^32 + 1 means "past row M" (the group
    takes every remaining row), not 1; so does 2^31; -2^32 + 1 is negative
    (no rows), not 1. Equal to lax.ragged_dot on the clamped sizes."""
    m, k, n = 24, 16, 8
    x, w, t = inputs(rng, m, k, n, 3, dtype)
    with jax.enable_x64(True):
        for sizes in ([5, 2**32 + 1, 3], [-2**32 + 1, 7, 2**31]):
            s = jnp.asarray(sizes, jnp.int64)
            out = jax.jit(pk_jax.grouped_matmul)(x, w, s)
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
            assert rel_err(out, dense(x, w, sizes)) < tol, sizes
            dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(
                pk_jax.grouped_matmul(x, w, s).astype(jnp.float32) * t), (0, 1)))(x, w)
            want_dx, want_dw = dense_grads(x, w, sizes, t)
            assert rel_err(dx, want_dx) < tol and rel_err(dw, want_dw) < tol, sizes


def test_clamped_sizes_saturate_without_int32_overflow():
    """Many groups of nearly 2^31 rows each: the running sum saturates at M
    instead of wrapping negative."""
    sizes = jnp.full((4,), 2**31 - 1, jnp.int32)
    np.testing.assert_array_equal(np.asarray(prim.clamped_sizes(sizes, 2**31 - 2)),
                                  [2**31 - 2, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(prim.clamped_sizes(jnp.asarray([3, -4, 9, 2]), 10)),
                                  [3, 0, 7, 0])


def test_float64_is_computed_in_float64(rng):
    """float64 operands accumulate in float64 (the XLA path): the result is
    the float64 dense product to float64 precision, not fp32's."""
    m, k, n, sizes = 16, 8, 8, [5, 11]
    with jax.enable_x64(True):
        x, w = (jnp.asarray(rng.standard_normal(sh), jnp.float64) for sh in ((m, k), (2, k, n)))
        out = pk_jax.grouped_matmul(x, w, jnp.asarray(sizes))
        assert out.dtype == jnp.float64
        assert rel_err(out, dense(x, w, sizes)) < 1e-13
        out32 = pk_jax.grouped_matmul(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
        assert out32.dtype == jnp.float32 and rel_err(out32, dense(x, w, sizes)) < 1e-7


def test_unknown_preferred_element_type_is_named():
    x, w = jnp.ones((4, 8)), jnp.ones((2, 8, 8))
    with pytest.raises(TypeError, match="preferred_element_type must be a dtype.*'bogus'"):
        pk_jax.grouped_matmul(x, w, jnp.asarray([2, 2]), preferred_element_type="bogus")
