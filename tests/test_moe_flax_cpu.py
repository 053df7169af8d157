"""pk_jax.flax.MoE and examples/moe.py on 8 fake CPU devices: the layer
against a dense reference (every token through its top-k SwiGLU experts,
global parameters), and the example trained with pk and with the XLA
ragged baseline: the losses agree and drop."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh, rel_err
from pk_jax.flax import MoE, init_sharded, partition_specs

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "moe.py"
_spec = importlib.util.spec_from_file_location("moe_example", _PATH)
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example
_spec.loader.exec_module(example)


def _dense_moe(params, x, top_k):
    """Every token through its top-k experts with the global weights."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    w, ids = jax.lax.top_k(probs, top_k)
    w = w / w.sum(-1, keepdims=True)
    g = jnp.einsum("td,tkdf->tkf", x, params["gate"][ids])
    u = jnp.einsum("td,tkdf->tkf", x, params["up"][ids])
    y = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g) * u, params["down"][ids])
    return jnp.einsum("tk,tkd->td", w, y)


@pytest.mark.parametrize("layer,top_k,axis_type", [
    ("pk", 1, AxisType.Auto), ("pk", 2, AxisType.Explicit), ("pk", 8, AxisType.Explicit),
    ("xla_ragged", 2, AxisType.Auto), ("xla_ragged", 8, AxisType.Explicit)])
def test_layer_matches_dense(rng, layer, top_k, axis_type):
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("ep",), axis_types=(axis_type,))
    cls = {"pk": MoE, "xla_ragged": example.XlaRaggedMoE}[layer]
    graphdef, state = init_sharded(
        lambda: cls(16, 12, 8, top_k, axis_name="ep", num_shards=4, rngs=nnx.Rngs(0)), mesh)
    x = jax.device_put(jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
                       NamedSharding(mesh, P("ep")))

    @jax.shard_map(mesh=mesh, in_specs=(partition_specs(state), P("ep")), out_specs=P("ep"))
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    params = {k[-1]: jnp.asarray(np.asarray(v[...])) for k, v in nnx.to_flat_state(state)}
    cot = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    with jax.set_mesh(mesh):
        out = jax.jit(apply)(state, x)
        gx, gs = jax.jit(jax.grad(lambda x, s: jnp.sum(apply(s, x) * cot), argnums=(0, 1)))(
            x, state)
    xs = np.asarray(x)
    ref = jax.jit(_dense_moe, static_argnums=2)(params, xs, top_k)
    assert rel_err(out, ref) < 1e-5
    ref_gx, ref_gp = jax.jit(jax.grad(lambda x, p: jnp.sum(_dense_moe(p, x, top_k) * cot),
                                      argnums=(0, 1)))(xs, params)
    assert rel_err(gx, ref_gx) < 1e-4
    grads = {k[-1]: np.asarray(v[...]) for k, v in nnx.to_flat_state(gs)}
    for name in ("router", "gate", "up", "down"):
        if top_k == 1 and name == "router":  # one renormalized weight: exactly 1
            assert np.abs(grads[name]).max() < 1e-5 and np.abs(ref_gp[name]).max() < 1e-5
            continue
        assert rel_err(grads[name], ref_gp[name]) < 1e-4, name


def test_layer_bf16_matches_xla_ragged(rng):
    """In bfloat16 (the grouped GEMMs through pk's primitive, not the
    float32 fallback) pk's layer and the XLA baseline give the same values
    and gradients: each device's expert-weight gradients are its own rows'."""
    mesh = cpu_mesh((4,), ("ep",))
    x = jax.device_put(jnp.asarray(rng.standard_normal((64, 16)), jnp.float32),
                       NamedSharding(mesh, P("ep")))
    cot = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    got = {}
    for name, cls in (("pk", MoE), ("xla_ragged", example.XlaRaggedMoE)):
        graphdef, state = init_sharded(
            lambda: cls(16, 16, 8, 2, axis_name="ep", num_shards=4, dtype=jnp.bfloat16,
                        rngs=nnx.Rngs(0)), mesh)

        @jax.shard_map(mesh=mesh, in_specs=(partition_specs(state), P("ep")),
                       out_specs=P("ep"))
        def apply(state, x, graphdef=graphdef):
            return nnx.merge(graphdef, state)(x).astype(jnp.float32)

        with jax.set_mesh(mesh):
            gx, gs = jax.jit(jax.grad(lambda x, s: jnp.sum(apply(s, x) * cot),
                                      argnums=(0, 1)))(x, state)
        got[name] = dict(x=np.asarray(gx), **{k[-1]: np.asarray(v[...])
                                              for k, v in nnx.to_flat_state(gs)})
    for name in ("x", "router", "gate", "up", "down"):
        assert rel_err(got["pk"][name], got["xla_ragged"][name]) < 1e-2, name


def test_layer_errors():
    with pytest.raises(ValueError, match="num_experts"):
        MoE(8, 8, 6, 2, axis_name="ep", num_shards=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="top_k=9"):
        MoE(8, 8, 8, 9, axis_name="ep", num_shards=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mechanism"):
        MoE(8, 8, 8, 2, axis_name="ep", num_shards=4, rngs=nnx.Rngs(0), mechanism="nccl")
    other = cpu_mesh((2,), ("ep",))
    f = jax.shard_map(
        lambda x: MoE(8, 8, 8, 2, axis_name="ep", num_shards=4, rngs=nnx.Rngs(0))(x),
        mesh=other, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(ValueError, match="num_shards=4"):
        jax.jit(f)(jnp.ones((8, 8)))


@pytest.mark.parametrize("axis_types", [AxisType.Explicit, AxisType.Auto])
def test_pk_and_xla_ragged_train_alike(axis_types):
    mesh = example.make_mesh(8, axis_types)
    logs: list[str] = []
    res = example.compare(8, example.Config(), mesh, log=logs.append)
    pk, xla = res["runs"]["pk"][0], res["runs"]["xla_ragged"][0]
    assert len(pk) == len(xla) == 8
    np.testing.assert_allclose(pk, xla, rtol=1e-4)
    assert pk[-1] < 0.5 * pk[0], pk
    assert any("step time: pk" in line for line in logs)
