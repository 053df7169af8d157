"""pk_jax.matmul_all_reduce on fake CPU devices: values and gradients against
lax.psum(x @ w) (Auto and Explicit meshes), input checks, the CUDA lowering
(cross-lowered: one custom call, its attributes and channels, no XLA
all-reduce), the plain-jit route and a Flax drop-in model."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, ffi_attr, rel_err
from pk_jax import tuning
from pk_jax.ops.tp_matmul import primitive as tp_primitive
from pk_jax.partitioning import record_routes

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def _fn(mesh, op, x_spec=P(None, "tp"), w_spec=P("tp", None), names="tp"):
    """shard_map of op(x, w) with a replicated result: shard_map's check_vma
    refuses a result that still varies over the axis, so this also checks
    that the op's result is typed invariant, as psum's is."""
    return jax.jit(jax.shard_map(lambda x, w: op(x, w, names), mesh=mesh,
                                 in_specs=(x_spec, w_spec), out_specs=P()))


def _psum(x, w, names, out_dtype=None):
    y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
    return lax.psum(y, names)


@pytest.mark.usefixtures("sharding_mode")
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [16, 24 * 8 + 8])  # one_shot / chunked under auto (n | rows)
def test_values_match_psum(rng, n, dtype, rows):
    mesh = cpu_mesh((n,), ("tp",))
    x = _put(mesh, _normal(rng, (rows, 16 * n), dtype), P(None, "tp"))
    w = _put(mesh, _normal(rng, (16 * n, 24), dtype), P("tp", None))
    out = _fn(mesh, pk_jax.matmul_all_reduce)(x, w)
    assert out.shape == (rows, 24) and out.dtype == dtype
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(out, ref) < TOL[dtype]
    # the same as XLA's dot + psum (which sums the same rounded partials)
    assert rel_err(out, _fn(mesh, _psum)(x, w)) < TOL[dtype]


@pytest.mark.usefixtures("sharding_mode")
def test_batch_dims_and_preferred_element_type(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x = _put(mesh, _normal(rng, (3, 5, 32), jnp.bfloat16), P(None, None, "tp"))
    w = _put(mesh, _normal(rng, (32, 16), jnp.bfloat16), P("tp", None))
    op = lambda a, b, names: pk_jax.matmul_all_reduce(a, b, names,
                                                      preferred_element_type=jnp.float32)
    out = _fn(mesh, op, P(None, None, "tp"))(x, w)
    assert out.shape == (3, 5, 16) and out.dtype == jnp.float32
    ref = np.einsum("bsk,kn->bsn", np.asarray(x, np.float32), np.asarray(w, np.float32))
    assert rel_err(out, ref) < 1e-6


def _grads(mesh, op, x, w, x_spec, w_spec, names):
    def loss(x, w):
        y = jax.shard_map(lambda a, b: op(a, b, names), mesh=mesh, in_specs=(x_spec, w_spec),
                          out_specs=P())(x, w)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))
    return jax.jit(jax.grad(loss, (0, 1)))(x, w)


@pytest.mark.usefixtures("sharding_mode")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_psum(rng, dtype):
    """psum's transpose gives every rank the whole cotangent: dx = dy @ w^T
    and dw = x^T @ dy, no collective."""
    mesh = cpu_mesh((4,), ("tp",))
    x = _put(mesh, _normal(rng, (12, 32), dtype), P(None, "tp"))
    w = _put(mesh, _normal(rng, (32, 16), dtype), P("tp", None))
    ours = _grads(mesh, pk_jax.matmul_all_reduce, x, w, P(None, "tp"), P("tp", None), "tp")
    ref = _grads(mesh, _psum, x, w, P(None, "tp"), P("tp", None), "tp")
    for g, r, a in zip(ours, ref, (x, w)):
        assert g.shape == a.shape and g.dtype == a.dtype
        assert rel_err(g, r) < TOL[dtype]


def test_gradients_with_an_fp32_result(rng):
    """bf16 operands, fp32 result: the fp32 cotangent meets the bf16 weight."""
    mesh = cpu_mesh((2,), ("tp",))
    x = _put(mesh, _normal(rng, (8, 32), jnp.bfloat16), P(None, "tp"))
    w = _put(mesh, _normal(rng, (32, 16), jnp.bfloat16), P("tp", None))
    op = lambda a, b, names: pk_jax.matmul_all_reduce(a, b, names,
                                                      preferred_element_type=jnp.float32)
    ref = lambda a, b, names: _psum(a, b, names, jnp.float32)
    ours = _grads(mesh, op, x, w, P(None, "tp"), P("tp", None), "tp")
    for g, r, a in zip(ours, _grads(mesh, ref, x, w, P(None, "tp"), P("tp", None), "tp"),
                       (x, w)):
        assert g.dtype == a.dtype and rel_err(g, r) < 1e-2


@pytest.mark.usefixtures("sharding_mode")
def test_gradients_on_a_2d_mesh_sum_the_weight_over_the_other_axis(rng):
    """Rows over "dp", the contraction over "tp": w is replicated over dp,
    so its gradient sums every dp shard's (as lax.psum's does)."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = _put(mesh, _normal(rng, (8, 32)), P("dp", "tp"))
    w = _put(mesh, _normal(rng, (32, 16)), P("tp", None))
    out_of = lambda op: jax.jit(jax.shard_map(lambda a, b: op(a, b, "tp"), mesh=mesh,
                                              in_specs=(P("dp", "tp"), P("tp", None)),
                                              out_specs=P("dp")))
    assert rel_err(out_of(pk_jax.matmul_all_reduce)(x, w), np.asarray(x) @ np.asarray(w)) < 1e-6

    def grads(op):
        loss = lambda a, b: jnp.sum(jnp.sin(out_of(op)(a, b)))
        return jax.jit(jax.grad(loss, (0, 1)))(x, w)
    for g, r in zip(grads(pk_jax.matmul_all_reduce), grads(_psum)):
        assert rel_err(g, r) < 1e-6


def test_repeated_calls_in_scan(rng):
    mesh = cpu_mesh((4,), ("tp",))
    w = _normal(rng, (16, 16)) / 4

    def run(op):
        def body(x, w):
            def step(c, _):  # c replicated; this rank's share of the features
                i = lax.axis_index("tp")
                part = lax.dynamic_slice_in_dim(jnp.tanh(c), i * 4, 4, axis=1)
                return op(part, w, "tp"), None
            return lax.scan(step, x, None, length=5)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("tp", None)),
                                     out_specs=P()))
    x = _normal(rng, (8, 16))
    assert rel_err(run(pk_jax.matmul_all_reduce)(x, w), run(_psum)(x, w)) < 1e-5


def test_auto_picks_by_rows():
    assert tuning.matmul_all_reduce_mechanism(16, 2) == "one_shot"
    assert tuning.matmul_all_reduce_mechanism(256, 2) == "one_shot"
    assert tuning.matmul_all_reduce_mechanism(8192, 2) == "chunked"
    assert tuning.matmul_all_reduce_mechanism(8193, 2) == "one_shot"  # rows not divisible


@pytest.mark.parametrize("call,match,error", [
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((4, 8)), jnp.ones((6, 8)), "tp"),
     r"contraction mismatch, x \(4, 8\) @ w \(6, 8\)", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((8,)), jnp.ones((8, 8)), "tp"),
     "expected x", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((4, 8)), jnp.ones((8, 8, 2)), "tp"),
     "w", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((0, 8)), jnp.ones((8, 8)), "tp"),
     "empty operands", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 8), jnp.int32),
                                      "tp"), "x must be floating point", TypeError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp",
                                      mechanism="two_shot"), "mechanism must be", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp",
                                      mechanism="one_shot"), "bf16 or fp16", ValueError),
    (lambda: pk_jax.matmul_all_reduce(jnp.ones((3, 8), jnp.bfloat16),
                                      jnp.ones((8, 8), jnp.bfloat16), "tp", mechanism="chunked"),
     "rows of x .* must divide", ValueError),
])
def test_bad_input(call, match, error):
    mesh = cpu_mesh((2,), ("tp",))
    f = jax.shard_map(lambda: call(), mesh=mesh, in_specs=(), out_specs=P(), check_vma=False)
    with pytest.raises(error, match=match):
        jax.jit(f)()


# ---- the CUDA lowering, cross-lowered ------------------------------------------
def _lowered(mesh, fn, shapes, specs, dtype=jnp.bfloat16):
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _ar_calls(hlo):
    return re.findall(r"custom_call @pk_matmul_all_reduce\(.*", hlo)


def _channel(call, which):
    """The dictionary of attribute `which` ("channel" or "gather_channel")."""
    return re.search(r"\b" + which + r" = \{(.*?)\}", call).group(1)


@pytest.mark.parametrize("rows,one_shot", [(64, True), (1024, False)])
def test_lowering_is_one_kernel_call(cuda_lowering, rows, one_shot):
    mesh = cpu_mesh((2,), ("tp",))
    fwd = jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "tp"), mesh=mesh,
                        in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
    hlo = _lowered(mesh, fwd, [(rows, 256), (256, 512)], [P(None, "tp"), P("tp", None)])
    call, = _ar_calls(hlo)
    assert "stablehlo.all_reduce" not in hlo
    mechanism = tp_primitive.ALL_REDUCE_KERNEL_MECHANISMS["one_shot" if one_shot else "chunked"]
    assert re.search(r"mechanism = (\d+) : i32", call).group(1) == str(mechanism)
    ch, gather = _channel(call, "channel"), _channel(call, "gather_channel")
    assert ffi_attr(ch, "group_size") == "2" and ffi_attr(ch, "group_ids") == "dense<[0, 1]>"
    slot_rows = rows if one_shot else rows // 2
    assert int(ffi_attr(ch, "data_bytes")) >= 2 * slot_rows * 512 * 2  # n slots, bf16
    if one_shot:
        assert ffi_attr(gather, "slot") == ffi_attr(ch, "slot")
    else:  # the reduced chunks travel on a channel of their own
        assert ffi_attr(gather, "slot") != ffi_attr(ch, "slot")
        assert int(ffi_attr(gather, "data_bytes")) >= 2 * slot_rows * 512 * 2
        regions = sorted((int(ffi_attr(c, "data_offset")), int(ffi_attr(c, "data_bytes")))
                         for c in (ch, gather))
        assert regions[0][0] + regions[0][1] <= regions[1][0]  # disjoint


def test_lowering_of_the_gradient_has_no_collective(cuda_lowering):
    """psum's transpose is the identity on values: the backward is two local
    dots, and the forward the kernel; mechanism="xla" shows XLA's psum."""
    mesh = cpu_mesh((2,), ("tp",))

    def loss(mechanism):
        def f(x, w):
            y = jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "tp",
                                                                    mechanism=mechanism),
                              mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                              out_specs=P())(x, w)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(f, (0, 1))
    shapes, specs = [(512, 256), (256, 512)], [P(None, "tp"), P("tp", None)]
    hlo = _lowered(mesh, loss("auto"), shapes, specs)
    assert len(_ar_calls(hlo)) == 1 and "stablehlo.all_reduce" not in hlo
    hlo = _lowered(mesh, loss("xla"), shapes, specs)
    assert _ar_calls(hlo) == [] and "stablehlo.all_reduce" in hlo


def test_fp32_takes_xla_under_auto_and_raises_when_forced(cuda_lowering, monkeypatch):
    monkeypatch.setattr("pk_jax._warnings._seen", set())  # one-time per process
    mesh = cpu_mesh((2,), ("tp",))
    shapes, specs = [(64, 256), (256, 512)], [P(None, "tp"), P("tp", None)]

    def fwd(mechanism):
        return jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "tp",
                                                                   mechanism=mechanism),
                             mesh=mesh, in_specs=tuple(specs), out_specs=P())
    with pytest.warns(pk_jax.PkJaxFallbackWarning, match="bf16 or fp16"):
        hlo = _lowered(mesh, fwd("auto"), shapes, specs, jnp.float32)
    assert _ar_calls(hlo) == [] and "stablehlo.all_reduce" in hlo
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _lowered(mesh, fwd("one_shot"), shapes, specs, jnp.float32)


# ---- plain jit and Flax ----------------------------------------------------------
@pytest.mark.usefixtures("sharding_mode")
def test_plain_jit_routes_a_replicated_result_to_matmul_all_reduce(rng):
    mesh = cpu_mesh((4,), ("x",))
    x = _put(mesh, _normal(rng, (2, 8, 32)), P(None, None, "x"))
    w = _put(mesh, _normal(rng, (32, 24)), P("x", None))
    f = jax.jit(pk_jax.matmul, out_shardings=NamedSharding(mesh, P()))
    jax.clear_caches()
    with record_routes() as routes:
        y = f(x, w)
        gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), (0, 1)))(x, w)
    assert ("matmul_all_reduce", ("x",)) in {(r.route, r.axes) for r in routes
                                             if r.op == "dot_general"}
    xs, ws = np.asarray(x), np.asarray(w)
    assert rel_err(y, xs @ ws) < 1e-5
    rx, rw = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), (0, 1))(xs, ws)
    assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


class _Mlp(nnx.Module):
    """An unmodified Flax model: two nnx.Linear layers (the drop-in only
    swaps their dot_general)."""

    def __init__(self, dot_general, rngs):
        kw = {} if dot_general is None else {"dot_general": dot_general}
        self.up = nnx.Linear(16, 64, rngs=rngs, **kw)
        self.down = nnx.Linear(64, 16, rngs=rngs, **kw)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.usefixtures("sharding_mode")
def test_flax_dropin_mlp_gets_matmul_all_reduce(rng):
    """Megatron's MLP without sequence parallelism (up's kernel sharded on
    columns, down's on rows, activations replicated): the down projection
    routes to matmul_all_reduce, values and gradients as the plain model."""
    from test_partitioning_cpu import _compare_models
    mesh = cpu_mesh((4,), ("x",))
    x = _put(mesh, _normal(rng, (2, 8, 16)), P())
    specs = {"up/kernel": P(None, "x"), "up/bias": P("x"), "down/kernel": P("x", None)}
    build = lambda pk: _Mlp(pk_jax.flax.dot_general if pk else None, nnx.Rngs(0))
    routes = _compare_models(build, specs, mesh, x, P(), P())
    assert ("matmul_all_reduce", ("x",)) in {(r.route, r.axes) for r in routes
                                             if r.op == "dot_general"}
