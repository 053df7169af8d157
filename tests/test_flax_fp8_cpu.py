"""pk_jax.flax's layers with FP8 recipes (fp8=) on fake CPU devices, Auto and
Explicit meshes: values and parameter gradients against float32 references
on the global weights, with test_fp8_cpu.py's tolerances (FWD_TOL for one
FP8 GEMM, GRAD_TOL for gradients with an e5m2 dy; twice both for two FP8
GEMMs deep); delayed scaling's histories (the amaxes a call records, the
scales they give, amax(dy) through the gradient and update_fp8_state, an
NNX training step); and the errors for bad input."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from pk_jax.flax import (ColumnParallelLinear, Fp8AmaxHistory, Fp8GradAmaxHistory,
                         ParallelMLP, RingSelfAttention, RowParallelLinear, fp8_wrt,
                         init_sharded, partition_specs, update_fp8_state)
from test_flax_layers_cpu import HD, HKV, HQ, _host, _linear, _ref_attention, _ref_mlp

FWD_TOL, GRAD_TOL = 0.06, 0.10  # test_fp8_cpu.py's, per FP8 GEMM
N = 2  # devices of the tensor-parallel axis


@dataclasses.dataclass(frozen=True)
class Case:
    """A layer on a mesh for a size multiple `m` (16, or 128 for block
    scaling): its factory, input shape and specs, the reference and how many
    FP8 GEMMs deep its output is."""

    mesh: tuple[tuple[int, ...], tuple[str, ...]]
    build: Callable[[int, object], nnx.Module]  # (m, fp8) -> module
    x_shape: Callable[[int], tuple[int, ...]]
    in_spec: P
    out_spec: P
    reference: Callable
    depth: int = 1


CASES = {
    "column": Case(((N,), ("tp",)),
                   lambda m, fp8: ColumnParallelLinear(2 * m, m, axis_name="tp", use_bias=True,
                                                       rngs=nnx.Rngs(0), fp8=fp8),
                   lambda m: (N * m, 2 * m), P("tp"), P(None, "tp"), _linear),
    "row": Case(((N,), ("tp",)),
                lambda m, fp8: RowParallelLinear(m, 2 * m, axis_name="tp", use_bias=True,
                                                 rngs=nnx.Rngs(0), fp8=fp8),
                lambda m: (N * m, N * m), P(None, "tp"), P("tp"), _linear),
    "row_all_reduce": Case(((N,), ("tp",)),
                           lambda m, fp8: RowParallelLinear(m, 2 * m, axis_name="tp",
                                                            reduce="all_reduce",
                                                            rngs=nnx.Rngs(0), fp8=fp8),
                           lambda m: (m, N * m), P(None, "tp"), P(), _linear),
    # no axis: pk_jax.fp8_dot on rows sharded over "dp", the kernel replicated
    "local": Case(((N,), ("dp",)),
                  lambda m, fp8: ColumnParallelLinear(2 * m, m, axis_name=None,
                                                      rngs=nnx.Rngs(0), fp8=fp8),
                  lambda m: (N * m, 2 * m), P("dp"), P("dp"), _linear),
    "mlp": Case(((N,), ("tp",)),
                lambda m, fp8: ParallelMLP(m, m, axis_name="tp", use_bias=True,
                                           rngs=nnx.Rngs(0), fp8=fp8),
                lambda m: (N * m, m), P("tp"), P("tp"), _ref_mlp, depth=2),
    # an axis of one device: gate and up as separate FP8 matmuls (but with delayed scaling)
    "mlp_one_device": Case(((1,), ("tp",)),
                           lambda m, fp8: ParallelMLP(m, m, axis_name="tp", use_bias=True,
                                                      rngs=nnx.Rngs(0), fp8=fp8),
                           lambda m: (N * m, m), P("tp"), P("tp"), _ref_mlp, depth=2),
    # heads sharded over "tp", sequence over "sp": 16 rows per device
    "attention": Case(((2, N), ("sp", "tp")),
                      lambda m, fp8: RingSelfAttention(HQ // N, HKV // N, HD, 16,
                                                       axis_name="sp", tp_axis_name="tp",
                                                       rngs=nnx.Rngs(0), fp8=fp8),
                      lambda m: (2 * N, 16, 16), P("tp", "sp"), P("tp", "sp"),
                      _ref_attention, depth=2),
}
RECIPES = ("current", "delayed", "block")


def _histories(tree):
    return nnx.state(tree, Fp8AmaxHistory)


def _setup(case: Case, recipe, rng):
    """Mesh, apply(state, x) -> (y, histories after the call) run per
    shard, the state with fresh random parameters (histories as built),
    and a global input."""
    m = 128 if pk_jax.Fp8Recipe(recipe).scaling == "block" else 16
    mesh = cpu_mesh(*case.mesh)
    graphdef, state = init_sharded(lambda: case.build(m, recipe), mesh)
    specs = partition_specs(state)
    flat = [(path, v.replace(jax.device_put(
                np.asarray(rng.standard_normal(v.shape) / 4, v.dtype),
                NamedSharding(mesh, v.get_metadata()["pk_spec"])))
             if isinstance(v, nnx.Param) else v)
            for path, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)

    def per_shard(st, x):
        model = nnx.merge(graphdef, st)
        return model(x), _histories(model)

    hist_specs = jax.tree.map(lambda _: P(), _histories(state))
    apply = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(specs, case.in_spec),
                                  out_specs=(case.out_spec, hist_specs)))
    x = jax.device_put(rng.standard_normal(case.x_shape(m)).astype(np.float32),
                       NamedSharding(mesh, case.in_spec))
    return apply, state, x


def _params(tree):
    return nnx.state(tree, nnx.Param)


# Not ("attention", "block"): block scaling needs 128-multiples of the heads, more than
# this case has (the Flax example's fp8_block preset trains it: test_flax_example_cpu.py).
@pytest.mark.parametrize("name,recipe", [(name, recipe) for name in CASES for recipe in RECIPES
                                         if (name, recipe) != ("attention", "block")])
def test_fp8_layer_values_and_gradients(rng, name, recipe, sharding_mode):
    case = CASES[name]
    apply, state, x = _setup(case, recipe, rng)
    ref = jax.jit(case.reference)(_host(state), _host(x))
    y, _ = apply(state, x)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    assert rel_err(y, ref) < case.depth * FWD_TOL

    cot = rng.standard_normal(ref.shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda st: jnp.sum(apply(st, x)[0] * cot)))(state)
    ref_grads = jax.jit(jax.grad(lambda st: jnp.vdot(case.reference(st, _host(x)), cot)))(
        _host(_params(state)))
    got, want = jax.tree.leaves(_params(grads)), jax.tree.leaves(ref_grads)
    assert len(got) == len(want) > 0
    for g, r in zip(got, want):
        assert g.shape == r.shape and rel_err(g, r) < case.depth * GRAD_TOL


@pytest.mark.parametrize("name,recipe,matmuls", [("mlp", "current", 2),
                                                  ("mlp_one_device", "current", 3),
                                                  ("mlp_one_device", "block", 3),
                                                  ("mlp_one_device", "delayed", 2)])
def test_fp8_mlp_joins_gate_and_up(rng, name, recipe, matmuls):
    """gate and up run as one FP8 matmul (joined kernels) on an axis of
    several devices or with delayed scaling's shared state, as two on one
    device otherwise (the forward's FP8 GEMMs: gate|up or gate, up; down)."""
    apply, state, x = _setup(CASES[name], recipe, rng)
    assert str(jax.make_jaxpr(apply)(state, x)).count("pk_fp8_matmul") == matmuls


def test_fp8_mlp_state_layout():
    """The FP8 MLP keeps the bf16 MLP's parameters; with "delayed" the joined
    gate|up matmul and down keep histories, replicated, not nnx.Param."""
    plain = nnx.state(ParallelMLP(16, 16, axis_name=None, rngs=nnx.Rngs(0)))
    mlp = ParallelMLP(16, 16, axis_name=None, rngs=nnx.Rngs(0),
                      fp8=pk_jax.Fp8Recipe("delayed", amax_history_len=5))
    assert jax.tree.structure(_params(mlp)) == jax.tree.structure(plain)
    hist = _histories(mlp)
    paths = sorted(".".join(map(str, p)) for p, _ in nnx.to_flat_state(hist))
    assert paths == ["down.fp8_state.grad", "down.fp8_state.kernel", "down.fp8_state.x",
                     "gate_up_fp8_state.grad", "gate_up_fp8_state.kernel",
                     "gate_up_fp8_state.x"]
    for path, v in nnx.to_flat_state(hist):
        assert v.shape == (5,) and v.get_metadata()["pk_spec"] == P()
        assert isinstance(v, Fp8GradAmaxHistory) == (path[-1] == "grad")
    assert not _histories(ParallelMLP(16, 16, axis_name=None, rngs=nnx.Rngs(0), fp8="current"))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_histories(rng, algo, sharding_mode):
    """One call of a delayed-scaling ColumnParallelLinear over "tp": it
    quantizes with the scales its histories give (the same bits as
    all_gather_matmul with those scales), records the axis-wide amax(x) and
    amax(w), and amax(dy) arrives as the dy history's gradient, which
    update_fp8_state rolls in."""
    recipe = pk_jax.Fp8Recipe("delayed", margin=1.0, amax_history_len=4, amax_compute_algo=algo)
    mesh = cpu_mesh((N,), ("tp",))
    graphdef, state = init_sharded(lambda: ColumnParallelLinear(
        32, 16, axis_name="tp", rngs=nnx.Rngs(1), fp8=recipe), mesh)
    start = {"x": [2.0, 5.0, 0, 0], "kernel": [0.25, 0, 0, 0], "grad": [3.0, 4.0, 1.0, 0]}
    for key, values in start.items():
        state["fp8_state"][key][...] = jax.device_put(np.float32(values),
                                                      NamedSharding(mesh, P()))
    pick = (lambda h: max(h)) if algo == "max" else (lambda h: h[0])
    scales = tuple(jnp.float32(fmax / 2 / pick(start[k]))
                   for k, fmax in (("x", 448.0), ("kernel", 448.0), ("grad", 57344.0)))
    x = rng.standard_normal((N * 16, 32)).astype(np.float32)
    cot = jnp.asarray(rng.standard_normal((N * 16, N * 16)), jnp.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp")))
    specs = partition_specs(state)
    hist_specs = jax.tree.map(lambda _: P(), _histories(state))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(specs, P("tp")), out_specs=(P(None, "tp"), hist_specs))
    def apply(st, x):
        model = nnx.merge(graphdef, st)
        return model(x), _histories(model)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(None, "tp"), P("tp"), P()), out_specs=P(None, "tp"))
    def direct(w, x, s):
        return pk_jax.all_gather_matmul(x, w, "tp", fp8=recipe, fp8_scales=s)[0]

    y, after = apply(state, xs)
    w = state["kernel"][...]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(direct(w, xs, scales)))
    amax = lambda a: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32))))
    hist = lambda st, key: np.asarray(st["fp8_state"][key][...]).tolist()
    assert hist(after, "x") == [amax(x), 2.0, 5.0, 0.0]
    assert hist(after, "kernel") == [amax(w), 0.25, 0.0, 0.0]
    assert hist(after, "grad") == start["grad"]  # the forward leaves dy's alone

    grads = jax.jit(jax.grad(lambda st: jnp.sum(apply(st, xs)[0] * cot)))(state)
    assert np.asarray(grads["fp8_state"]["grad"][...]).tolist() == [amax(cot), 0, 0, 0]
    assert not np.any(np.asarray(grads["fp8_state"]["x"][...]))  # x's: no gradient
    new = update_fp8_state(after, grads)
    assert hist(new, "grad") == [amax(cot), 3.0, 4.0, 1.0]
    assert hist(new, "x") == hist(after, "x") and hist(new, "kernel") == hist(after, "kernel")


def test_nnx_training_step_with_delayed_scaling(rng):
    """The NNX pattern of pk_jax/flax/fp8.py, on one device (no axis):
    nnx.Optimizer(wrt=nnx.Param) trains the parameters only; the forward
    records x's and w's amaxes; update_fp8_state records dy's."""
    model = ParallelMLP(32, 32, axis_name=None, rngs=nnx.Rngs(0), fp8="delayed")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

    def loss_fn(model, x, t):
        return jnp.mean((model(x) - t) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x, t):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, fp8_wrt()))(
            model, x, t)
        optimizer.update(model, grads)
        update_fp8_state(model, grads)
        return loss

    assert not jax.tree.leaves(nnx.state(optimizer.opt_state, Fp8AmaxHistory))
    losses = [float(train_step(model, optimizer, x, t)) for _ in range(2)]
    w = jnp.concatenate([model.gate.kernel[...], model.up.kernel[...]], axis=1)
    losses.append(float(train_step(model, optimizer, x, t)))
    assert losses[-1] < losses[0]
    gate_up = model.gate_up_fp8_state
    assert np.asarray(gate_up.x[...]).tolist()[:4] == [float(jnp.max(jnp.abs(x)))] * 3 + [0]
    assert float(gate_up.kernel[...][0]) == float(jnp.max(jnp.abs(w)))  # w of the last step
    assert not np.array_equal(np.asarray(w), np.asarray(jnp.concatenate(
        [model.gate.kernel[...], model.up.kernel[...]], axis=1)))  # the optimizer trained w
    for state in (gate_up, model.down.fp8_state):
        dy = np.asarray(state.grad[...])
        assert np.all(dy[:3] > 0) and not np.any(dy[3:])  # three steps recorded


def test_fp8_bad_input(rng):
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="fp8 must be None, a pk_jax.Fp8Recipe"):
        ColumnParallelLinear(32, 16, axis_name="tp", rngs=rngs, fp8="e4m3")
    with pytest.raises(TypeError, match="fp8 must be"):
        RowParallelLinear(16, 32, axis_name="tp", rngs=rngs, fp8=8)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(fp8='current'\): "
                                         r"out_features_local \(24\) must be a multiple of 16"):
        ColumnParallelLinear(32, 24, axis_name="tp", rngs=rngs, fp8="current")
    with pytest.raises(ValueError, match=r"hidden_features_local \(64\) must be a multiple "
                                         r"of 128"):
        ParallelMLP(128, 64, axis_name="tp", rngs=rngs, fp8="block")
    with pytest.raises(ValueError, match=r"\(num_heads \+ 2 \* num_kv_heads\) \* head_dim "
                                         r"\(40\)"):
        RingSelfAttention(3, 1, 8, 16, axis_name="sp", rngs=rngs, fp8="current")
    with pytest.raises(ValueError, match="with fp8 the mechanism must be 'auto'"):
        RowParallelLinear(16, 32, axis_name="tp", rngs=rngs, fp8="current", mechanism="xla")
    with pytest.raises(ValueError, match="return_gathered"):
        ColumnParallelLinear(32, 16, axis_name=None, rngs=rngs, fp8="current")(
            jnp.ones((16, 32)), return_gathered=True)
    with pytest.raises(ValueError, match="rows of x"):  # fp8_dot: 8 rows
        ColumnParallelLinear(32, 16, axis_name=None, rngs=rngs, fp8="current")(
            jnp.ones((8, 32)))

    # delayed scaling without the dy update: gradients of the parameters only
    model = ColumnParallelLinear(32, 16, axis_name=None, rngs=rngs, fp8="delayed")
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((16, 32)))))(model)
    with pytest.raises(ValueError, match=r"no gradient for the dy amax history "
                                         r"fp8_state.grad.*fp8_wrt\(\)"):
        update_fp8_state(model, grads)
    with pytest.raises(TypeError, match="grads must be an nnx.State"):
        update_fp8_state(model, {"fp8_state": None})
