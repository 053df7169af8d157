"""Helpers shared by the Flax tests (CPU and GPU)."""

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def sharded_apply(model_fn, specs, mesh, x_spec, out_spec, **call_kw):
    """Global state laid out by `specs` (path suffix -> PartitionSpec) and a
    jitted apply(state, x) of the model."""
    graphdef, state = nnx.split(model_fn())

    def place(path, a):
        key = "/".join(str(p.key) for p in path if hasattr(p, "key"))  # no ".value"
        spec = next((s for suffix, s in specs.items() if key.endswith(suffix)), P())
        return jax.device_put(a, NamedSharding(mesh, spec))

    state = jax.tree_util.tree_map_with_path(place, state)
    apply = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, **call_kw),
                    in_shardings=(None, NamedSharding(mesh, x_spec)),
                    out_shardings=NamedSharding(mesh, out_spec))
    return apply, state
