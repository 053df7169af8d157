"""pk_jax.flax layers on fake CPU devices: each module runs inside a jitted
jax.shard_map on its parameter shards and is checked, values and gradients
(w.r.t. the input and every parameter), against plain jnp on the global
weights; mechanism="xla" gives the same; bad configurations raise."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from pk_jax.flax import (ColumnParallelLinear, ParallelMLP, RingSelfAttention,
                         RowParallelLinear, init_sharded, partition_specs, shard_size)

# Every test of this file runs on Auto and on Explicit meshes.
pytestmark = pytest.mark.usefixtures("sharding_mode")

F, HIDDEN, HQ, HKV, HD = 16, 32, 4, 2, 8  # features, MLP hidden, heads, kv heads, head dim


def _w(state: nnx.State, *path: str) -> jax.Array:
    """The global array of one parameter of a (global) state."""
    for p in path:
        state = state[p]
    return state[...]


def _linear(layer: nnx.State, x: jax.Array) -> jax.Array:
    """x @ kernel (+ bias) with a linear layer's global weights."""
    y = x @ _w(layer, "kernel")
    return y + _w(layer, "bias") if "bias" in layer else y


def _ref_mlp(state, x):
    return _linear(state["down"], jax.nn.silu(_linear(state["gate"], x)) * _linear(state["up"], x))


def _ref_attention(state, x):
    b, s, _ = x.shape
    heads = lambda a, h: a.reshape(b, s, h, HD)
    o = jax.nn.dot_product_attention(heads(_linear(state["q"], x), HQ),
                                     heads(_linear(state["k"], x), HKV),
                                     heads(_linear(state["v"], x), HKV), is_causal=True)
    return _linear(state["out"], o.reshape(b, s, HQ * HD))


@dataclasses.dataclass(frozen=True)
class Case:
    """One module on a mesh: how to build it (local sizes for the mesh), the
    input/output specs, the global input shape and the reference."""

    mesh_shape: Callable[[int], tuple[int, ...]]
    names: tuple[str, ...]
    build: Callable[..., nnx.Module]  # (mesh sizes dict, mechanism) -> module
    x_shape: Callable[[int], tuple[int, ...]]
    in_spec: P
    out_spec: P
    reference: Callable[[nnx.State, jax.Array], jax.Array]
    check_vma: bool = True


def _attention(n: dict, mechanism: str, tp_axis_name=None) -> RingSelfAttention:
    tp = n.get("tp", 1)
    return RingSelfAttention(HQ // tp, HKV // tp, HD, F, axis_name="sp",
                             tp_axis_name=tp_axis_name, causal=True, rngs=nnx.Rngs(0),
                             mechanism=mechanism)  # no bias: k's gets no gradient


CASES = {
    "column": Case(lambda n: (n,), ("tp",),
                   lambda n, m: ColumnParallelLinear(F, 24 // n["tp"], axis_name="tp",
                                                     use_bias=True, rngs=nnx.Rngs(0),
                                                     mechanism=m),
                   lambda n: (4 * n, 3, F), P("tp"), P(None, None, "tp"), _linear),
    "row": Case(lambda n: (n,), ("tp",),
                lambda n, m: RowParallelLinear(24 // n["tp"], F, axis_name="tp", use_bias=True,
                                               rngs=nnx.Rngs(0), mechanism=m),
                lambda n: (4 * n, 24), P(None, "tp"), P("tp"), _linear),
    "row_all_reduce": Case(lambda n: (n,), ("tp",),
                           lambda n, m: RowParallelLinear(24 // n["tp"], F, axis_name="tp",
                                                          use_bias=True, rngs=nnx.Rngs(0),
                                                          mechanism=m, reduce="all_reduce"),
                           lambda n: (5, 3, 24), P(None, None, "tp"), P(), _linear),
    "mlp": Case(lambda n: (n,), ("tp",),
                lambda n, m: ParallelMLP(F, HIDDEN // n["tp"], axis_name="tp", use_bias=True,
                                         rngs=nnx.Rngs(0), mechanism=m),
                lambda n: (2 * n, 5, F), P("tp"), P("tp"), _ref_mlp),
    "attention_sp": Case(lambda n: (n,), ("sp",), lambda n, m: _attention(n, m),
                         lambda n: (2, 4 * n, F), P(None, "sp"), P(None, "sp"), _ref_attention),
    "attention_sp_tp": Case(lambda n: (2, n // 2), ("sp", "tp"),
                            lambda n, m: _attention(n, m, tp_axis_name="tp"),
                            lambda n: (4, 8, F), P("tp", "sp"), P("tp", "sp"), _ref_attention),
}


def _setup(case: Case, n: int, rng, mechanism: str = "auto"):
    """Mesh, the sharded apply function, fresh global weights and input."""
    mesh = cpu_mesh(case.mesh_shape(n), case.names)
    sizes = dict(mesh.shape)
    graphdef, state = init_sharded(lambda: case.build(sizes, mechanism), mesh)
    # Fresh random global weights (not the initializer's), laid out as the
    # module's (on Explicit meshes shard_map takes inputs sharded as in_specs).
    specs = partition_specs(state)
    leaves, treedef = jax.tree.flatten(state)
    state = treedef.unflatten([
        jax.device_put(np.asarray(rng.standard_normal(a.shape) / 4, a.dtype),
                       NamedSharding(mesh, s))
        for a, s in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P)))])
    apply = jax.jit(jax.shard_map(lambda st, x: nnx.merge(graphdef, st)(x), mesh=mesh,
                                  in_specs=(specs, case.in_spec),
                                  out_specs=case.out_spec, check_vma=case.check_vma))
    x = jax.device_put(rng.standard_normal(case.x_shape(n)).astype(np.float32),
                       NamedSharding(mesh, case.in_spec))
    return apply, state, x


def _host(tree):
    """The same values, unsharded (the references run on plain arrays)."""
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients(rng, name, n):
    case = CASES[name]
    apply, state, x = _setup(case, n, rng)
    ref = jax.jit(case.reference)(_host(state), _host(x))
    out = apply(state, x)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5

    cot = rng.standard_normal(ref.shape).astype(np.float32)
    loss = lambda st, x: jnp.sum(apply(st, x) * cot)
    grads = jax.jit(jax.grad(loss, (0, 1)))(state, x)
    ref_grads = jax.jit(jax.grad(lambda st, x: jnp.vdot(case.reference(st, x), cot), (0, 1)))(
        _host(state), _host(x))
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(leaves) == len(ref_leaves) == len(jax.tree.leaves(state)) + 1
    for g, r in zip(leaves, ref_leaves):
        assert g.shape == r.shape and rel_err(g, r) < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_xla_mechanism_matches(rng, name):
    case = CASES[name]
    seed = int(rng.integers(1 << 30))
    outs = []
    for mechanism in ("auto", "xla"):
        apply, state, x = _setup(case, 4, np.random.default_rng(seed), mechanism)
        outs.append(np.asarray(apply(state, x)))
    assert rel_err(outs[1], outs[0]) < 1e-6


def test_zigzag_layout(rng):
    """layout="zigzag": the sequence reordered by zigzag_shard gives the
    reference's output in the same order."""
    mesh = cpu_mesh((4,), ("sp",))
    factory = lambda: RingSelfAttention(HQ, HKV, HD, F, axis_name="sp", layout="zigzag",
                                        rngs=nnx.Rngs(1))
    graphdef, state = init_sharded(factory, mesh)
    apply = jax.jit(jax.shard_map(lambda st, x: nnx.merge(graphdef, st)(x), mesh=mesh,
                                  in_specs=(partition_specs(state), P(None, "sp")),
                                  out_specs=P(None, "sp")))
    x = rng.standard_normal((2, 32, F)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
    out = pk_jax.zigzag_unshard(apply(state, pk_jax.zigzag_shard(xs, 4)), 4)
    assert rel_err(out, _ref_attention(_host(state), x)) < 1e-5


def test_init_does_not_depend_on_mesh():
    """init_sharded draws global weights: 1, 2 and 4 shards give one model."""
    weights = []
    for n in (1, 2, 4):
        mesh = cpu_mesh((n,), ("tp",))
        _, state = init_sharded(lambda: ParallelMLP(F, HIDDEN // n, axis_name="tp",
                                                    rngs=nnx.Rngs(3)), mesh)
        weights.append([np.asarray(a) for a in jax.tree.leaves(state)])
    # The same random draws (another key or split would differ by O(1));
    # programs compiled for other shardings may round the normal transform
    # an ulp apart (seen at XLA:CPU's -O0, conftest.py).
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    specs = partition_specs(state)
    assert specs["gate"]["kernel"] == P(None, "tp") and specs["down"]["kernel"] == P("tp", None)


def test_bad_configurations():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="must divide by the number of shards"):
        shard_size(HIDDEN + 2, 4, "hidden_features")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        RingSelfAttention(6, 4, HD, F, axis_name="sp", rngs=rngs)
    with pytest.raises(ValueError, match="layout"):
        RingSelfAttention(HQ, HKV, HD, F, axis_name="sp", layout="striped", rngs=rngs)
    with pytest.raises(ValueError, match="mechanism"):
        ColumnParallelLinear(F, 8, axis_name="tp", mechanism="nccl", rngs=rngs)
    with pytest.raises(ValueError, match="positive int"):
        RowParallelLinear(0, F, axis_name="tp", rngs=rngs)
    with pytest.raises(ValueError, match="reduce must be one of"):
        RowParallelLinear(8, F, axis_name="tp", reduce="psum", rngs=rngs)
    with pytest.raises(ValueError, match="mechanism"):  # one_shot: all_reduce only
        RowParallelLinear(8, F, axis_name="tp", mechanism="one_shot", rngs=rngs)
    RowParallelLinear(8, F, axis_name="tp", mechanism="one_shot", reduce="all_reduce",
                      rngs=rngs)
    with pytest.raises(ValueError, match="expected input"):
        ColumnParallelLinear(F, 8, axis_name=None, rngs=rngs)(jnp.ones((4, F + 1)))


def test_rows_not_divisible_raises(rng):
    mesh = cpu_mesh((4,), ("tp",))
    graphdef, state = init_sharded(
        lambda: RowParallelLinear(8, F, axis_name="tp", rngs=nnx.Rngs(0)), mesh)
    apply = jax.shard_map(lambda st, x: nnx.merge(graphdef, st)(x), mesh=mesh,
                          in_specs=(partition_specs(state), P(None, "tp")), out_specs=P("tp"))
    with pytest.raises(ValueError, match="must divide by the size of axis"):
        apply(state, jax.device_put(jnp.ones((6, 32)), NamedSharding(mesh, P(None, "tp"))))
