"""pk_jax.partitioning on 8 fake CPU devices: plain-jit programs over sharded
arrays, checked (values and gradients) against jnp / jax.nn, with the route
each partition callback chose (record_routes) and the collectives in the
compiled HLO; Flax models not written for pk_jax, with only dot_general /
attention_fn injected, against the same models without them."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
import pk_jax._warnings as pk_warnings
import pk_jax.flax  # the drop-ins (flax is optional, not imported by pk_jax)
from conftest import cpu_mesh
from helpers.flax_util import sharded_apply
from pk_jax.partitioning import record_routes

# Every test of this file runs on Auto and on Explicit meshes.
pytestmark = pytest.mark.usefixtures("sharding_mode")

_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _put(mesh, rng, shape, spec, dtype=np.float32):
    return jax.device_put(np.asarray(rng.standard_normal(shape), dtype), NamedSharding(mesh, spec))


def _collectives(compiled_text: str) -> set[str]:
    return set(_COLLECTIVE.findall(compiled_text))


def _routes(routes, op: str) -> set[tuple[str, tuple]]:
    return {(r.route, r.axes) for r in routes if r.op == op}


def _check_grads(f, ref, args, tol=1e-4):
    """Gradients of sum(sin(f(*args))) w.r.t. every arg match the reference's."""
    loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))))
    grads = jax.jit(jax.grad(loss(f), tuple(range(len(args)))))(*args)
    ref_grads = jax.jit(jax.grad(loss(ref), tuple(range(len(args)))))(
        *(np.asarray(a) for a in args))
    for g, r, a in zip(grads, ref_grads, args):
        assert g.shape == a.shape and g.dtype == a.dtype
        assert _rel(g, r) < tol


# ---- dot_general routing on a 1-D mesh ------------------------------------------
# name: (x shape, x spec, w shape, w spec, out spec or None, forward route,
#        collectives allowed in the forward HLO)
DOT_CASES = {
    "rows_x_features": ((2, 16, 12), P(None, "x", None), (12, 32), P(None, "x"), None,
                        "all_gather_matmul", {"all-gather"}),
    "contraction_rows_out": ((16, 32), P(None, "x"), (32, 24), P("x", None), P("x", None),
                             "matmul_reduce_scatter", {"reduce-scatter"}),
    "contraction_replicated_out": ((16, 32), P(None, "x"), (32, 24), P("x", None), P(),
                                   "matmul_all_reduce", {"all-reduce"}),
    "unsharded": ((16, 32), P(), (32, 24), P(), None, "local", set()),
    "rows_only": ((16, 32), P("x", None), (32, 24), P(), None, "local", set()),
}


@pytest.mark.parametrize("name", list(DOT_CASES))
def test_dot_routes_values_and_gradients(rng, name):
    xs, xspec, ws, wspec, out_spec, route, allowed = DOT_CASES[name]
    mesh = cpu_mesh((8,), ("x",))
    x, w = _put(mesh, rng, xs, xspec), _put(mesh, rng, ws, wspec)
    out = None if out_spec is None else NamedSharding(mesh, out_spec)
    f = jax.jit(pk_jax.matmul, out_shardings=out)
    jax.clear_caches()
    with record_routes() as routes:
        compiled = f.lower(x, w).compile()
    expected_axes = () if route == "local" else ("x",)
    assert _routes(routes, "dot_general") == {(route, expected_axes)}
    assert _collectives(compiled.as_text()) == allowed
    y = f(x, w)
    assert y.shape == xs[:-1] + ws[-1:] and y.dtype == jnp.float32
    assert _rel(y, np.asarray(x) @ np.asarray(w)) < 1e-5
    _check_grads(pk_jax.matmul, jnp.matmul, (x, w))


def test_backward_is_routed_too(rng):
    """The transpose of an all_gather_matmul (d_x) runs as a matmul_reduce_scatter."""
    mesh = cpu_mesh((8,), ("x",))
    x, w = _put(mesh, rng, (16, 12), P("x", None)), _put(mesh, rng, (12, 32), P(None, "x"))
    jax.clear_caches()
    with record_routes() as routes:
        jax.jit(jax.grad(lambda x, w: jnp.sum(pk_jax.matmul(x, w) ** 2))).lower(x, w).compile()
    assert ("all_gather_matmul", ("x",)) in _routes(routes, "dot_general")
    assert ("matmul_reduce_scatter", ("x",)) in _routes(routes, "dot_general_transpose")


def test_dot_general_dimension_numbers(rng):
    """A transposed weight (contracting its dim 1) and a batched dot_general."""
    mesh = cpu_mesh((8,), ("x",))
    x, wt = _put(mesh, rng, (16, 12), P("x", None)), _put(mesh, rng, (32, 12), P("x", None))
    dims = (((1,), (1,)), ((), ()))
    f = lambda x, w: pk_jax.dot_general(x, w, dims)
    ref = lambda x, w: jax.lax.dot_general(x, w, dims)
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(f)(x, wt)
    assert _routes(routes, "dot_general") == {("all_gather_matmul", ("x",))}
    assert _rel(y, ref(np.asarray(x), np.asarray(wt))) < 1e-5
    _check_grads(f, ref, (x, wt))

    a, b = _put(mesh, rng, (8, 4, 6), P("x")), _put(mesh, rng, (8, 6, 5), P("x"))
    bdims = (((2,), (1,)), ((0,), (0,)))
    f = lambda a, b: pk_jax.dot_general(a, b, bdims)
    ref = lambda a, b: jax.lax.dot_general(a, b, bdims)
    assert _rel(jax.jit(f)(a, b), ref(np.asarray(a), np.asarray(b))) < 1e-5
    _check_grads(f, ref, (a, b))
    assert _rel(jax.jit(pk_jax.matmul)(a, b), np.asarray(a) @ np.asarray(b)) < 1e-5


# ---- 2-D mesh ------------------------------------------------------------------
def test_2d_mesh_tensor_and_data_parallel_mlp(rng):
    """Batch over "dp", sequence over "tp" (Megatron sequence parallelism):
    the up projection gathers the sequence over tp, the down projection
    reduce-scatters it back; the batch stays sharded over dp."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = _put(mesh, rng, (4, 8, 16), P("dp", "tp", None))
    w1, w2 = _put(mesh, rng, (16, 32), P(None, "tp")), _put(mesh, rng, (32, 16), P("tp", None))
    mlp = lambda mm: (lambda x, w1, w2: mm(jax.nn.gelu(mm(x, w1)), w2))
    f = jax.jit(mlp(pk_jax.matmul), out_shardings=NamedSharding(mesh, P("dp", "tp", None)))
    jax.clear_caches()
    with record_routes() as routes:
        y = f(x, w1, w2)
    fwd = [r for r in routes if r.op == "dot_general"]
    assert [(r.route, r.axes) for r in fwd] == [("all_gather_matmul", ("tp",)),
                                                ("matmul_reduce_scatter", ("tp",))]
    assert fwd[0].out_specs == (P("dp", None, "tp"),)
    assert y.sharding.spec == P("dp", "tp", None)
    assert _rel(y, mlp(jnp.matmul)(*(np.asarray(a) for a in (x, w1, w2)))) < 1e-5
    _check_grads(mlp(pk_jax.matmul), mlp(jnp.matmul), (x, w1, w2))


def test_2d_mesh_rows_over_two_axes(rng):
    """Rows sharded over ("dp", "tp"), features over "tp": the gather runs over
    tp only and the result keeps its rows sharded over dp."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x, w = _put(mesh, rng, (16, 12), P(("dp", "tp"), None)), _put(mesh, rng, (12, 8),
                                                                    P(None, "tp"))
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(pk_jax.matmul)(x, w)
    [route] = [r for r in routes if r.op == "dot_general"]
    assert (route.route, route.axes, route.out_specs) == ("all_gather_matmul", ("tp",),
                                                          (P("dp", "tp"),))
    assert _rel(y, np.asarray(x) @ np.asarray(w)) < 1e-5
    _check_grads(pk_jax.matmul, jnp.matmul, (x, w))


def test_gspmd_propagation(rng):
    """With Shardy off, the GSPMD callbacks route the same way."""
    try:
        jax.config.update("jax_use_shardy_partitioner", False)
    except Exception as e:  # a JAX without GSPMD propagation
        pytest.skip(f"cannot turn Shardy off: {e}")
    try:
        mesh = cpu_mesh((8,), ("x",))
        x, w = _put(mesh, rng, (2, 16, 12), P(None, "x")), _put(mesh, rng, (12, 32),
                                                                 P(None, "x"))
        jax.clear_caches()
        with record_routes() as routes:
            y = jax.jit(pk_jax.matmul)(x, w)
        assert _routes(routes, "dot_general") == {("all_gather_matmul", ("x",))}
        assert y.sharding.spec == P(None, None, "x")
        assert _rel(y, np.asarray(x) @ np.asarray(w)) < 1e-5
        _check_grads(pk_jax.matmul, jnp.matmul, (x, w))
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
        jax.clear_caches()


# ---- attention -----------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mesh_shape,spec,route", [
    ((8,), P(None, "x"), "ring_attention"),              # sequence over 8
    ((2, 4), P("dp", "x", None), "ring_attention"),      # batch dp, sequence x
    ((4, 2), P(None, "x", "dp"), "ring_attention"),      # sequence x, heads dp
    ((8,), P("x"), "attention"),                         # batch only: no ring
])
def test_attention(rng, causal, mesh_shape, spec, route):
    names = ("x",) if len(mesh_shape) == 1 else ("dp", "x") if spec[0] == "dp" else ("x", "dp")
    mesh = cpu_mesh(mesh_shape, names)
    q = _put(mesh, rng, (8, 32, 4, 8), spec)
    k, v = (_put(mesh, rng, (8, 32, 2, 8), spec) for _ in range(2))  # GQA: 2 kv heads
    f = lambda q, k, v: pk_jax.dot_product_attention(q, k, v, causal=causal)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    jax.clear_caches()
    with record_routes() as routes:
        compiled = jax.jit(f).lower(q, k, v).compile()
    assert _routes(routes, "attention") == {(route, ("x",) if route == "ring_attention" else ())}
    # the ring passes K/V blocks around; nothing is gathered
    assert _collectives(compiled.as_text()) == (
        {"collective-permute"} if route == "ring_attention" else set())
    y = jax.jit(f)(q, k, v)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), y.ndim), y.sharding
    assert _rel(y, jax.jit(ref)(*(np.asarray(a) for a in (q, k, v)))) < 1e-5
    _check_grads(f, ref, (q, k, v))


def test_attention_cross_lengths(rng):
    """Fewer keys than queries: no ring; plain attention, still correct."""
    mesh = cpu_mesh((8,), ("x",))
    q = _put(mesh, rng, (2, 32, 4, 8), P(None, "x"))
    k, v = (_put(mesh, rng, (2, 16, 4, 8), P(None, "x")) for _ in range(2))
    f = lambda q, k, v: pk_jax.dot_product_attention(q, k, v)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(f)(q, k, v)
    assert _routes(routes, "attention") == {("attention", ())}
    assert _rel(y, jax.jit(ref)(*(np.asarray(a) for a in (q, k, v)))) < 1e-5
    _check_grads(f, ref, (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_value_head_dim(rng, causal):
    """Values with their own head dim Dv (jax.nn refuses them): plain
    attention per device, never the ring; values and gradients against a
    softmax written out (GQA: 4 query heads on 2 kv heads)."""
    mesh = cpu_mesh((2,), ("x",))
    q = _put(mesh, rng, (2, 8, 4, 8), P(None, "x"))
    k, v = _put(mesh, rng, (2, 8, 2, 8), P(None, "x")), _put(mesh, rng, (2, 8, 2, 3), P(None, "x"))
    f = lambda q, k, v: pk_jax.dot_product_attention(q, k, v, causal=causal, scale=0.4)

    def ref(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.einsum("bshd,bthd->bhst", q, k) * 0.4
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -jnp.inf)
        return jnp.einsum("bhst,bthe->bshe", jax.nn.softmax(s, axis=-1), v)
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(f)(q, k, v)
    assert _routes(routes, "attention") == {("attention", ())}
    assert y.shape == (2, 8, 4, 3) and _rel(y, jax.jit(ref)(*(np.asarray(a) for a in (q, k, v)))) < 1e-5
    _check_grads(f, ref, (q, k, v))


# ---- Flax models not written for pk_jax -----------------------------------------
class _Mlp(nnx.Module):
    def __init__(self, dot_general, rngs, out_sharding=None):
        kw = {} if dot_general is None else {"dot_general": dot_general}
        self.up = nnx.Linear(16, 64, rngs=rngs, **kw)
        self.down = nnx.Linear(64, 16, rngs=rngs, **kw)
        self.out_sharding = out_sharding

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)), out_sharding=self.out_sharding)


class _Attention(nnx.Module):
    def __init__(self, attention_fn, rngs, dot_general=None):
        kw = {} if attention_fn is None else {"attention_fn": attention_fn}
        if dot_general is not None:
            kw.update(qkv_dot_general=dot_general, out_dot_general=dot_general)
        self.attn = nnx.MultiHeadAttention(4, 16, 32, decode=False, rngs=rngs, **kw)

    def __call__(self, x, mask=None):
        return self.attn(x, mask=mask, is_causal=mask is None)


def _compare_models(build, specs, mesh, x, x_spec, out_spec, **call_kw):
    """pk-injected model with its state laid out by `specs` vs the plain
    model on the same values unsharded (on Explicit meshes the plain model
    would need out_sharding annotations to run sharded): outputs and
    gradients; returns the routes of the pk model's compilations."""
    pk_apply, state = sharded_apply(lambda: build(True), specs, mesh, x_spec, out_spec,
                                    **call_kw)
    graphdef = nnx.split(build(False))[0]
    ref_apply = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, **call_kw))
    host = lambda tree: jax.tree.map(np.asarray, tree)
    jax.clear_caches()
    with record_routes() as routes:
        out = pk_apply(state, x)
        grads = jax.jit(jax.grad(lambda st, x: jnp.sum(jnp.sin(pk_apply(st, x))), (0, 1)))(
            state, x)
    ref_out = ref_apply(host(state), host(x))
    ref_grads = jax.jit(jax.grad(lambda st, x: jnp.sum(jnp.sin(ref_apply(st, x))), (0, 1)))(
        host(state), host(x))
    assert _rel(out, ref_out) < 1e-5
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads)):
        # absolute for the leaves whose gradient is zero (the key projection's bias)
        err = np.max(np.abs(np.asarray(g) - np.asarray(r)))
        assert _rel(g, r) < 1e-4 or err < 1e-5, jax.tree_util.keystr(path)
    return routes


def test_flax_linear_stack_unchanged(rng):
    mesh = cpu_mesh((8,), ("x",))
    specs = {"up/kernel": P(None, "x"), "up/bias": P("x"), "down/kernel": P("x", None)}
    x = _put(mesh, rng, (2, 16, 16), P(None, "x"))
    # The down projection's result is wanted sequence-sharded: on Explicit
    # meshes it must say so (out_sharding), as for jax's own dot; on Auto
    # meshes the jit's out_shardings reach it through propagation.
    rows = NamedSharding(mesh, P(None, "x"))
    build = lambda pk: (_Mlp(pk_jax.flax.dot_general, nnx.Rngs(0), rows) if pk
                        else _Mlp(None, nnx.Rngs(0)))
    routes = _compare_models(build, specs, mesh, x, P(None, "x"), P(None, "x"))
    assert ("all_gather_matmul", ("x",)) in _routes(routes, "dot_general")
    assert ("matmul_reduce_scatter", ("x",)) in _routes(routes, "dot_general")


def test_flax_multi_head_attention_unchanged(rng):
    mesh = cpu_mesh((8,), ("x",))
    x = _put(mesh, rng, (2, 32, 16), P(None, "x"))
    build = lambda pk: _Attention(pk_jax.flax.attention_fn if pk else None, nnx.Rngs(0))
    routes = _compare_models(build, {}, mesh, x, P(None, "x"), P(None, "x"))
    assert _routes(routes, "attention") == {("ring_attention", ("x",))}
    assert _routes(routes, "attention_vjp") == {("ring_attention", ("x",))}


def test_flax_multi_head_attention_sequence_and_heads_parallel(rng):
    """Sequence over "sp", heads over "tp" (the q/k/v/out projections'
    kernels sharded on heads, through pk_jax.flax.dot_general too): ring
    attention over sp with the heads split over tp."""
    mesh = cpu_mesh((4, 2), ("sp", "tp"))
    x = _put(mesh, rng, (2, 32, 16), P(None, "sp"))
    specs = {"query/kernel": P(None, "tp"), "key/kernel": P(None, "tp"),
             "value/kernel": P(None, "tp"), "query/bias": P("tp"), "key/bias": P("tp"),
             "value/bias": P("tp"), "out/kernel": P("tp")}
    build = lambda pk: _Attention(pk_jax.flax.attention_fn if pk else None, nnx.Rngs(0),
                                  pk_jax.flax.dot_general if pk else None)
    routes = _compare_models(build, specs, mesh, x, P(None, "sp"), P(None, "sp"))
    [attention] = {r for r in routes if r.op == "attention"}
    assert (attention.route, attention.axes) == ("ring_attention", ("sp",))
    assert attention.out_specs == (P(None, "sp", "tp", None),)
    # the out projection: a sharded contraction, result replicated
    assert ("matmul_all_reduce", ("tp",)) in _routes(routes, "dot_general")


def test_flax_attention_mask_falls_back(rng):
    """A mask: flax's own attention runs (after a one-time warning), same result."""
    mesh = cpu_mesh((8,), ("x",))
    x = _put(mesh, rng, (2, 32, 16), P(None, "x"))
    mask = nnx.make_causal_mask(jnp.ones((2, 32)))
    model = _Attention(pk_jax.flax.attention_fn, nnx.Rngs(0))
    ref = _Attention(None, nnx.Rngs(0))
    pk_warnings._seen.discard("attention_fn-mask")  # one-time per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.clear_caches()
        with record_routes() as routes:
            out = jax.jit(lambda x: model(x, mask))(x)
    assert any(issubclass(w.category, pk_jax.PkJaxFallbackWarning) and "mask" in str(w.message)
               for w in caught)
    assert not _routes(routes, "attention")
    assert _rel(out, ref(np.asarray(x), mask)) < 1e-5


def test_linen_dense(rng):
    mesh = cpu_mesh((8,), ("x",))
    dense = linen.Dense(32, dot_general=pk_jax.flax.dot_general)
    params = dense.init(jax.random.key(0), jnp.ones((16, 12)))
    params = jax.tree.map(lambda a: jax.device_put(
        a, NamedSharding(mesh, P(None, "x") if a.ndim == 2 else P("x"))), params)
    x = _put(mesh, rng, (16, 12), P("x", None))
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(dense.apply)(params, x)
    assert _routes(routes, "dot_general") == {("all_gather_matmul", ("x",))}
    ref = linen.Dense(32).apply(params, np.asarray(x))
    assert _rel(y, ref) < 1e-5


# ---- edge cases and bad shardings ------------------------------------------------
def test_contraction_sharded_on_different_axes_is_correct(rng):
    """lhs contraction over "dp", rhs contraction over "tp": the rhs is
    resharded to the lhs's axes (never a silently wrong sum)."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x, w = _put(mesh, rng, (8, 16), P(None, "dp")), _put(mesh, rng, (16, 12), P("tp", None))
    jax.clear_caches()
    with record_routes() as routes:
        y = jax.jit(pk_jax.matmul)(x, w)
    [route] = [r for r in routes if r.op == "dot_general"]
    assert route.in_specs == (P(None, "dp"), P("dp", None)) and route.axes == ("dp",)
    assert _rel(y, np.asarray(x) @ np.asarray(w)) < 1e-5
    _check_grads(pk_jax.matmul, jnp.matmul, (x, w))


def test_no_mesh_eager_shard_map_and_integers(rng):
    x, w = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(
        np.float32)
    assert _rel(pk_jax.matmul(x, w), x @ w) < 1e-6
    assert _rel(jax.jit(pk_jax.matmul)(x, w), x @ w) < 1e-6
    mesh = cpu_mesh((2,), ("x",))
    inside = jax.shard_map(pk_jax.matmul, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("x")), (w, P())))
    assert _rel(jax.jit(inside)(xs, ws), x @ w) < 1e-6
    mesh8 = cpu_mesh((8,), ("x",))
    a = jax.device_put(np.arange(64, dtype=np.int32).reshape(8, 8), NamedSharding(mesh8, P("x")))
    b = jax.device_put(np.ones((8, 8), np.int32), NamedSharding(mesh8, P(None, "x")))
    np.testing.assert_array_equal(jax.jit(pk_jax.matmul)(a, b), np.asarray(a) @ np.asarray(b))


def test_preferred_element_type_and_bf16(rng):
    mesh = cpu_mesh((8,), ("x",))
    x = _put(mesh, rng, (16, 16), P("x", None), jnp.bfloat16)
    w = _put(mesh, rng, (16, 32), P(None, "x"), jnp.bfloat16)
    f = lambda x, w: pk_jax.matmul(x, w, preferred_element_type=jnp.float32)
    y = jax.jit(f)(x, w)
    assert y.dtype == jnp.float32
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert _rel(y, ref) < 1e-2
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)), (0, 1)))(x, w)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


def test_clear_errors():
    with pytest.raises(TypeError, match="dot_general"):
        pk_jax.dot_general(jnp.ones((4, 5)), jnp.ones((6, 3)), (((1,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="pk_jax.matmul"):
        pk_jax.matmul(jnp.ones((2, 4, 5)), jnp.ones((3, 5, 6)))
    with pytest.raises(ValueError, match=r"must have rank 4 \[batch, seq, heads, head_dim\]"):
        pk_jax.dot_product_attention(jnp.ones((4, 2, 8)), jnp.ones((4, 2, 8)),
                                     jnp.ones((4, 2, 8)))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        q, kv = jnp.ones((1, 4, 3, 8)), jnp.ones((1, 4, 2, 8))
        pk_jax.dot_product_attention(q, kv, kv)
    with pytest.raises(TypeError, match="floating point"):
        x = jnp.ones((1, 4, 2, 8), jnp.int32)
        pk_jax.dot_product_attention(x, x, x)
    with pytest.raises(ValueError, match="scale must be finite"):
        x = jnp.ones((1, 4, 2, 8))
        pk_jax.dot_product_attention(x, x, x, scale=float("inf"))
    with pytest.raises(TypeError, match="causal must be a bool .*'no'"):
        pk_jax.dot_product_attention(x, x, x, causal="no")
    empty = jnp.ones((1, 4, 2, 0))  # head dim 0: the empty result, as jax.nn
    assert pk_jax.dot_product_attention(empty, empty, empty).shape == empty.shape


@pytest.mark.parametrize("dims", [((1, 0), ((), ())), "nope", (((1,), (0,)),),
                                  (((1.0,), (0,)), ((), ())), (((1,), (0,)), ((), (), ()))])
def test_malformed_dimension_numbers_are_named(dims):
    with pytest.raises(TypeError, match="dimension_numbers must be \\(\\(lhs_contracting"):
        pk_jax.dot_general(jnp.ones((4, 3)), jnp.ones((3, 2)), dims)


def test_bad_preferred_element_type_and_out_sharding_are_named(rng, sharding_mode):
    x, w = jnp.ones((4, 3)), jnp.ones((3, 2))
    with pytest.raises(TypeError, match="preferred_element_type must be a dtype.*'bogus'"):
        pk_jax.matmul(x, w, preferred_element_type="bogus")
    numbers = ("preferred_element_type must be a dtype of numbers \\(bool, integer, floating "
               "or complex, e.g. jnp.float32\\) or None, got <class 'object'>")
    with pytest.raises(TypeError, match="pk_jax.matmul: " + numbers):
        pk_jax.matmul(x, w, preferred_element_type=object)
    with pytest.raises(TypeError, match="pk_jax.dot_general: " + numbers):
        pk_jax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=object)
    for spec in ("x", 3):
        with pytest.raises(TypeError, match="pk_jax.matmul: out_sharding must be a "
                           "NamedSharding, a PartitionSpec or None, got .* \\((str|int)\\)"):
            pk_jax.matmul(x, w, out_sharding=spec)
    assert pk_jax.matmul(x, w, preferred_element_type=jnp.int32).dtype == jnp.int32
    assert pk_jax.matmul(x, w, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    mesh = cpu_mesh((2,), ("x",))
    xs = _put(mesh, rng, (4, 3), P("x"))
    f = lambda spec: jax.jit(lambda a, b: pk_jax.matmul(a, b, out_sharding=spec))
    # Auto: no mesh names the spec's axes; Explicit: the operands' mesh does
    no_mesh = ("PartitionSpec, which needs a mesh" if sharding_mode == "auto" else
               "names mesh axes \\['nope'\\]")
    with pytest.raises(ValueError, match="out_sharding=.*nope.*" + no_mesh):
        f(P("nope"))(xs, w)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="names mesh axes \\['nope'\\].*its axes: \\['x'\\]"):
            f(P("nope"))(xs, w)
        y = f(P("x"))(xs, w)  # a valid spec of the context's mesh
    assert _rel(y, np.asarray(xs) @ np.asarray(w)) < 1e-6
