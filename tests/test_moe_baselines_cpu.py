"""benchmarks/moe.py's checks on fake CPU devices: every exchange (pk's and
the baselines a user runs: sort + gather on one rank, sort + all_to_all with
a capacity and ragged_all_to_all across ranks) passes the check the
benchmark runs before timing, a wrong one fails it (so it cannot make a
headline), and the layer baselines match pk's layer."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_BENCH))  # the benchmark's own imports (common, baselines)
_spec = importlib.util.spec_from_file_location("moe_benchmark", _BENCH / "moe.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

E, T, K = 8, 32, 2
BASELINES = {1: {"sort_gather+scatter_add", "sort_gather+unsort"},
             4: {"a2a_capacity", "ragged_all_to_all"}}


def _inputs(rng, mesh, n):
    ids, w = bench._routing(rng, n, T, K, E)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
    return put(jnp.asarray(rng.standard_normal((n * T, 16)), jnp.bfloat16)), put(ids), put(w), ids


def _wrong(dispatch):
    """dispatch with the group sizes reversed: rows counted to other experts."""
    def f(*args):
        rows, sizes, state = dispatch(*args)
        return rows, sizes[::-1], state
    return f


@pytest.mark.parametrize("n", [1, 4])
def test_exchange_check(rng, n):
    mesh = cpu_mesh((n,), ("ep",))
    x, ids, w, ids_np = _inputs(rng, mesh, n)
    # equal routing weights: a dropped slot's row then weighs at least 1/K of a
    # token's (a small random weight could hide it under the check's 1%)
    w = jax.device_put(jnp.full(w.shape, 1.0 / K, w.dtype), w.sharding)
    capacity = bench._capacity(ids_np, n, E)
    ex = bench.exchanges(n, capacity)
    assert {name for name, (_, _, base) in ex.items() if base} == BASELINES[n]
    dispatch, combine, _ = ex["sort_gather+unsort" if n == 1 else "ragged_all_to_all"]
    ex["wrong"] = (_wrong(dispatch), combine, True)
    if n > 1:  # one row short of the capacity: a slot is dropped
        small = bench.exchanges(n, capacity - 1)["a2a_capacity"]
        ex["a2a_capacity_small"] = small
    with jax.set_mesh(mesh):
        fns = bench.exchange_fns(mesh, E, ex, chained=False)
        assert set(fns) == {"dispatch", "dispatch_combine", "check"}
        ok = bench.check_exchanges(fns["check"], x, ids, w)
    assert ok == set(ex) - {"wrong", "a2a_capacity_small"}
    # One dispatch row for the exchanges that share a dispatch.
    assert ("sort_gather" in fns["dispatch"]) == (n == 1)
    timed = {name for name in fns["dispatch"] if bench._passed("dispatch", name, ok)}
    assert timed == set(fns["dispatch"]) - {"wrong", "a2a_capacity_small"}


@pytest.mark.parametrize("n", [1, 4])
def test_layer_baselines_match_pk(rng, n):
    """The baselines' layers (on jax.lax.ragged_dot here: no Mosaic GPU
    kernel on CPUs) give pk's loss and gradients."""
    mesh = cpu_mesh((n,), ("ep",))
    x = jax.device_put(jnp.asarray(rng.standard_normal((n * T, 16)), jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    with jax.set_mesh(mesh):
        layers, state = bench.layer_fns(mesh, n, 16, 16, E, K, jnp.bfloat16, x, ())
        ok = bench.check_layers(layers, state, x)
    assert set(layers) == {"pk", "pk_xla"} | {f"{b}+lax_ragged_dot" for b in BASELINES[n]}
    assert ok == set(layers)
