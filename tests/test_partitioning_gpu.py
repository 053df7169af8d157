"""pk_jax.partitioning on 2 GPUs: plain-jit programs over NamedSharding
inputs must compile to the fused kernels (the pk custom calls, no XLA
all-gather / reduce-scatter for the routed matmuls, no gather of the
sequence for attention) and give the values and gradients of the plain
program, computed in float32 from the same bf16 inputs. And a Flax model not
written for pk_jax, with only `pk_jax.flax.dot_general` / `attention_fn`
injected, trains like the same model without them. Skipped with a reason
when fewer than 2 GPUs are visible.

Inputs are fresh every run (numpy's default_rng, seed named on failure;
`PK_JAX_TEST_SEED=<seed>` reruns with it).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
import pk_jax.flax  # the drop-ins (flax is optional, not imported by pk_jax)
from conftest import gpu_mesh
from helpers.flax_util import sharded_apply
from helpers.seeds import fresh_seed
from pk_jax.partitioning import record_routes

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
_XLA_GATHERS = re.compile(r"\b(all-gather|reduce-scatter)(?:-start)?\(")


def _put(mesh, key, shape, spec, dtype=BF16):
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_close(got, exact, same, what: str, seed: int) -> None:
    """`got` against the float32 result `exact`, with the error of the same
    program in bf16 through XLA (`same`) as the scale of what bf16 allows."""
    err, base = _rel(got, exact), _rel(same, exact)
    assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{what}: non-finite (seed {seed})"
    assert err <= 2 * base + 5e-3, (f"{what}: rel err {err:.3g} against float32, "
                                    f"bf16 XLA {base:.3g} (seed {seed})")


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def _grads(f, args):
    loss = lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)


# name: (x shape, x spec, w shape, w spec, out spec or None, route, pk custom call)
DOT_CASES = {
    "rows_x_features": ((2048, 1024), P("x", None), (1024, 2048), P(None, "x"), None,
                        "all_gather_matmul", "pk_all_gather_matmul"),
    "contraction_rows_out": ((2048, 2048), P(None, "x"), (2048, 1024), P("x", None),
                             P("x", None), "matmul_reduce_scatter", "pk_matmul_reduce_scatter"),
}


@pytest.mark.parametrize("name", list(DOT_CASES))
def test_matmul_routes_to_the_fused_kernel(name):
    mesh = gpu_mesh(2, "x")
    xs, xspec, ws, wspec, out_spec, route, call = DOT_CASES[name]
    seed = fresh_seed()
    kx, kw = jax.random.split(jax.random.key(seed))
    x, w = _put(mesh, kx, xs, xspec), _put(mesh, kw, ws, wspec)
    out = None if out_spec is None else NamedSharding(mesh, out_spec)
    f = jax.jit(pk_jax.matmul, out_shardings=out)
    jax.clear_caches()
    with record_routes() as routes:
        compiled = f.lower(x, w).compile().as_text()
    assert {(r.route, r.axes) for r in routes if r.op == "dot_general"} == {(route, ("x",))}
    assert call in compiled, f"no {call} custom call in the compiled program"
    assert not _XLA_GATHERS.findall(compiled), "XLA still gathers/scatters for the matmul"
    got = f(x, w)
    pk_jax.check_errors()
    with jax.default_matmul_precision("highest"):
        exact = jnp.matmul(*_f32(x, w))
        exact_grads = _grads(jnp.matmul, _f32(x, w))
    _check_close(got, exact, jnp.matmul(x, w), f"{name} values", seed)
    for nm, g, e, h in zip("xw", _grads(pk_jax.matmul, (x, w)), exact_grads,
                           _grads(jnp.matmul, (x, w))):
        assert g.shape == e.shape and g.dtype == BF16
        _check_close(g, e, h, f"{name} d{nm}", seed)
    pk_jax.check_errors()


@pytest.mark.parametrize("causal", [False, True])
def test_attention_routes_to_the_ring_kernel(causal):
    """Sequence-sharded q/k/v under plain jit: ring attention's fused kernel,
    a ppermute ring for the backward, nothing gathered."""
    mesh = gpu_mesh(2, "x")
    seed = fresh_seed()
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    spec = P(None, "x")
    q = _put(mesh, kq, (2, 2048, 8, 128), spec)
    k, v = (_put(mesh, kk_, (2, 2048, 2, 128), spec) for kk_ in (kk, kv))  # GQA
    f = lambda q, k, v: pk_jax.dot_product_attention(q, k, v, causal=causal)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    jax.clear_caches()
    with record_routes() as routes:
        compiled = jax.jit(f).lower(q, k, v).compile().as_text()
    assert {(r.route, r.axes) for r in routes if r.op == "attention"} == {
        ("ring_attention", ("x",))}
    assert "pk_ring_attention" in compiled, "no pk_ring_attention custom call"
    assert not re.search(r"\ball-gather(?:-start)?\(", compiled), "the sequence is gathered"
    got = jax.jit(f)(q, k, v)
    pk_jax.check_errors()
    assert got.sharding.spec == spec
    with jax.default_matmul_precision("highest"):
        exact = ref(*_f32(q, k, v))
        exact_grads = _grads(ref, _f32(q, k, v))
    _check_close(got, exact, ref(q, k, v), f"attention causal={causal}", seed)
    for nm, g, e, h in zip("qkv", _grads(f, (q, k, v)), exact_grads, _grads(ref, (q, k, v))):
        _check_close(g, e, h, f"attention causal={causal} d{nm}", seed)
    pk_jax.check_errors()


class _Mlp(nnx.Module):
    """A Flax model not written for pk_jax: two nnx.Linear layers (bf16)."""

    def __init__(self, dot_general, rngs: nnx.Rngs):
        kw = dict(dtype=BF16, rngs=rngs)
        if dot_general is not None:
            kw["dot_general"] = dot_general
        self.up = nnx.Linear(1024, 4096, **kw)
        self.down = nnx.Linear(4096, 1024, **kw)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def test_flax_model_with_dot_general_injected():
    """Column- then row-parallel Linear weights, tokens sharded: the injected
    dot_general routes the layers to the fused kernels; outputs and gradients
    match the model without it (the same bf16 computation through XLA)."""
    mesh = gpu_mesh(2, "x")
    seed = fresh_seed()
    specs = {"up/kernel": P(None, "x"), "up/bias": P("x"), "down/kernel": P("x", None)}
    x = _put(mesh, jax.random.key(seed), (4096, 1024), P("x", None))
    (pk_apply, state), (ref_apply, _) = (
        sharded_apply(lambda pk=pk: _Mlp(pk_jax.flax.dot_general if pk else None,
                                         nnx.Rngs(seed)), specs, mesh, P("x", None),
                      P("x", None)) for pk in (True, False))
    loss = lambda apply: (lambda st, x: jnp.mean(apply(st, x).astype(jnp.float32) ** 2))
    jax.clear_caches()
    with record_routes() as routes:
        out = pk_apply(state, x)
        grads = jax.jit(jax.grad(loss(pk_apply)))(state, x)
    pk_jax.check_errors()
    got_routes = {(r.route, r.axes) for r in routes if r.op == "dot_general"}
    assert ("all_gather_matmul", ("x",)) in got_routes
    assert ("matmul_reduce_scatter", ("x",)) in got_routes
    ref_out = ref_apply(state, x)
    ref_grads = jax.jit(jax.grad(loss(ref_apply)))(state, x)
    assert _rel(out, ref_out) < 2e-2, f"outputs differ (seed {seed})"
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads)):
        err = _rel(g, r)
        assert err < 3e-2, f"{jax.tree_util.keystr(path)}: rel {err:.3g} (seed {seed})"
