"""Random calls of every op (shapes, dtypes, axis sizes, mechanisms, layouts;
fresh each run, the seed in the failure message). Each call is classified
up front, from the documented support matrix, as valid or invalid: a valid
call must succeed, equal an independent reference on CPU devices and lower
for CUDA (cross-lowered with a stand-in for the extension); an invalid call
must raise the documented error type, naming pk_jax. An op that refused
every call, or accepted a bad one, fails. To replay a failure, set
PK_JAX_FUZZ_SEED to the seed its message names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.ops.all_gather import MECHANISMS as AG_MECHANISMS
from pk_jax.ops.ring_attention import LAYOUTS as RING_LAYOUTS
from pk_jax.ops.ring_attention import MECHANISMS as RING_MECHANISMS
from pk_jax.ops.ring_attention.primitive import KERNEL_MECHANISMS as RING_KERNEL_MECHANISMS
from pk_jax.ops.tp_matmul import MECHANISMS as TP_MECHANISMS
from conftest import cpu_mesh
from helpers.seeds import fresh_seed

LL_MAX_BYTES = 16 << 10  # all_gather's documented ld_st_ll limit per rank


def _expect(errors: set, what: str, call, check=None) -> None:
    """Run `call`. With no `errors` (a valid call) it must succeed and
    `check` its result; else it must raise one of the `errors` types, with
    a message naming pk_jax."""
    if not errors:
        try:
            result = call()
        except Exception as e:  # noqa: BLE001 - a valid call must not raise at all
            raise AssertionError(f"{what}: refused a valid call: {type(e).__name__}: {e}") from e
        if check is not None:
            check(result)
        return
    with pytest.raises(Exception) as info:
        call()
    e = info.value
    assert isinstance(e, tuple(errors)) and "pk_jax" in str(e), \
        f"{what}: expected {sorted(t.__name__ for t in errors)}, got {type(e).__name__}: {e}"


def _values(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, shape).astype(bool))
    return jnp.asarray(rng.integers(-50, 50, shape), dtype)


def _run(body, mesh, in_specs, out_spec, args):
    """`body` under shard_map on the CPU mesh."""
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                                 check_vma=False))(*args)


@pytest.fixture
def seed():
    return fresh_seed("PK_JAX_FUZZ_SEED")


def test_all_gather_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    dtypes = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.float16, jnp.bool_]
    for case in range(150):
        n = int(rng.choice([1, 2, 4, 8]))
        mesh = cpu_mesh((n, 8 // n), ("x", "y"))
        ndim = int(rng.integers(0, 4))
        local = tuple(int(d) for d in rng.integers(0 if rng.integers(8) == 0 else 1, 6, ndim))
        dtype = dtypes[rng.integers(len(dtypes))]
        tiled = bool(rng.integers(2)) and ndim > 0
        axis = int(rng.integers(-(ndim + 2), ndim + 2))
        mechanism = str(rng.choice(list(AG_MECHANISMS) + ["bogus"]))
        what = f"seed {seed} case {case}: n={n} local={local} {jnp.dtype(dtype).name} " \
               f"axis={axis} tiled={tiled} {mechanism}"
        # The support matrix (all_gather's docstring).
        out_ndim = ndim + (0 if tiled else 1)
        errors = set()
        if mechanism not in AG_MECHANISMS or not -out_ndim <= axis < out_ndim:
            errors.add(ValueError)
        elif mechanism == "ld_st_ll" and np.prod(local, dtype=int) > 0:
            dim = axis % out_ndim
            row_bytes = int(np.prod(local[dim:], dtype=int)) * jnp.dtype(dtype).itemsize
            if np.prod(local, dtype=int) * jnp.dtype(dtype).itemsize > LL_MAX_BYTES \
                    or row_bytes % 4:
                errors.add(ValueError)  # up to 16 KiB per rank of whole 4-byte words
        spec = P("x") if ndim else P()
        shape = ((local[0] * n,) + local[1:]) if ndim else ()
        host = np.asarray(_values(rng, shape, dtype))
        x = jax.device_put(host, NamedSharding(mesh, spec))
        ours = lambda a: pk_jax.all_gather(a, "x", axis=axis, tiled=tiled, mechanism=mechanism)

        def check(got):
            shards = np.split(host, n, axis=0) if ndim else [host] * n
            dim = axis % out_ndim
            want = np.concatenate(shards, dim) if tiled else np.stack(shards, dim)
            assert got.shape == want.shape and got.dtype == host.dtype, what
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=what)
            cuda_lowering(ours, mesh, spec, shape, dtype)
        _expect(errors, what, lambda: _run(ours, mesh, spec, P(), (x,)), check)


def test_tp_matmuls_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    dtypes = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]
    for case in range(60):
        n = int(rng.choice([1, 2, 4]))
        mesh = cpu_mesh((n,), ("x",))
        m, k, cols = (int(v) for v in rng.choice([1, 3, 8, 16, 24], 3))
        dtype = dtypes[rng.integers(len(dtypes))]
        out = [None, jnp.float32, jnp.bfloat16][rng.integers(3)]
        mechanism = str(rng.choice(list(TP_MECHANISMS) + ["fused"]))
        op = ["ag", "rs"][rng.integers(2)]
        what = f"seed {seed} case {case}: {op} n={n} m={m} k={k} N={cols} " \
               f"{jnp.dtype(dtype).name}->{out} {mechanism}"
        # The support matrix (the TP ops' docstrings): floating operands; the
        # kernels ("chunked") take bf16/fp16 with a result of their dtype or
        # float32 and per-device K and N multiples of 8.
        out_dtype = jnp.dtype(out or dtype)
        errors = set()
        if mechanism not in TP_MECHANISMS:
            errors.add(ValueError)
        elif not jnp.issubdtype(dtype, jnp.floating):
            errors.add(TypeError)
        elif mechanism == "chunked" and (
                dtype not in (jnp.bfloat16, jnp.float16) or k % 8 or cols % 8
                or out_dtype not in (jnp.dtype(dtype), jnp.dtype(jnp.float32))):
            errors.add(ValueError)
        if op == "ag":
            x, w = _values(rng, (n * m, k), dtype), _values(rng, (k, n * cols), dtype)
            specs, out_spec = (P("x"), P(None, "x")), P(None, "x")
            ours = lambda a, b: pk_jax.all_gather_matmul(a, b, "x", mechanism=mechanism,
                                                         preferred_element_type=out)
            want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        else:
            x, w = _values(rng, (m * n, k * n), dtype), _values(rng, (k * n, cols), dtype)
            specs, out_spec = (P(None, "x"), P("x", None)), P("x")
            ours = lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", mechanism=mechanism,
                                                             preferred_element_type=out)
            want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]

        def check(got):
            assert got.shape == want.shape and got.dtype == out_dtype, what
            # 16-bit results (and, for reduce-scatter, 16-bit partials) round each value
            tol = 3e-2 if min(out_dtype.itemsize, jnp.dtype(dtype).itemsize) == 2 else 1e-4
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol,
                                       atol=tol * np.sqrt(k * n), err_msg=what)
        _expect(errors, what, lambda: _run(ours, mesh, specs, out_spec, args), check)


def test_ring_attention_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    for case in range(40):
        n = int(rng.choice([1, 2, 3, 4]))
        mesh = cpu_mesh((n,), ("sp",))
        b, s = int(rng.integers(1, 3)), int(rng.choice([0, 1, 2, 6, 8, 16]))
        hkv = int(rng.choice([1, 2, 3]))
        hq = hkv * int(rng.choice([1, 2])) + int(rng.integers(0, 2)) * int(rng.integers(0, 2))
        d = int(rng.choice([8, 16, 64]))
        dtype = [jnp.float32, jnp.bfloat16][rng.integers(2)]
        kv_dtype = dtype if rng.integers(4) else jnp.float16
        causal, layout = bool(rng.integers(2)), str(rng.choice(["contiguous", "zigzag", "x"]))
        mechanism = str(rng.choice(list(RING_MECHANISMS) + ["nccl"]))
        what = f"seed {seed} case {case}: n={n} b={b} s_local={s} hq={hq} hkv={hkv} d={d} " \
               f"{jnp.dtype(dtype).name}/{jnp.dtype(kv_dtype).name} causal={causal} {layout} " \
               f"{mechanism}"
        # The support matrix (ring_attention's docstring): one dtype (else a
        # TypeError), Hq a multiple of Hkv, an even S_local for zigzag; the
        # forced kernel mechanisms take bf16/fp16, head dim 64 or 128 and
        # S_local a multiple of 128 (256 for zigzag), or an empty sequence;
        # "cudnn" bf16/fp16 and head dims multiple of 8 up to 256.
        errors = set()
        if mechanism not in RING_MECHANISMS or layout not in RING_LAYOUTS:
            errors.add(ValueError)
        if kv_dtype != dtype:
            errors.add(TypeError)
        if hq % hkv or (layout == "zigzag" and s % 2):
            errors.add(ValueError)
        if mechanism in RING_KERNEL_MECHANISMS and s and (
                dtype not in (jnp.bfloat16, jnp.float16) or d not in (64, 128)
                or s % (256 if layout == "zigzag" else 128)):
            errors.add(ValueError)
        if mechanism == "cudnn" and s and (dtype not in (jnp.bfloat16, jnp.float16)
                                           or d % 8 or d > 256):
            errors.add(ValueError)
        q = _values(rng, (b, n * s, hq, d), dtype)
        k, v = (_values(rng, (b, n * s, hkv, d), kv_dtype) for _ in range(2))
        seq = NamedSharding(mesh, P(None, "sp"))
        args = [jax.device_put(a, seq) for a in (q, k, v)]
        ours = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal,
                                                     layout=layout, mechanism=mechanism)

        def check(got):
            # Both layouts give the same global attention once reordered.
            qn, kn, vn = (q, k, v)
            if layout == "zigzag" and s:
                got = pk_jax.zigzag_unshard(got, n)
                qn, kn, vn = (pk_jax.zigzag_unshard(a, n) for a in (q, k, v))
            want = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (qn, kn, vn)),
                                                is_causal=causal)
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            assert got.shape == q.shape and got.dtype == dtype, what
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol,
                                       atol=tol, err_msg=what)
        _expect(errors, what, lambda: _run(ours, mesh, (P(None, "sp"),) * 3, P(None, "sp"),
                                           args), check)
