"""What the Flax modules (layers.py, moe.py) share: the global spec each
parameter carries (`pk_spec`), sizes, parameter creation. Not public API:
pk_jax.flax exports `init_sharded`, `partition_specs` and `shard_size`."""

from __future__ import annotations

import numbers
from typing import Callable

import jax
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

Initializer = Callable[..., jax.Array]
SPEC_KEY = "pk_spec"  # metadata key of a parameter's global PartitionSpec


def partition_specs(tree: nnx.Module | nnx.State) -> nnx.State:
    """The `PartitionSpec` of every variable of a module or state (P() for
    variables without `pk_spec` metadata, e.g. `nnx.RMSNorm`'s scale: they
    are replicated). Usable as shard_map in_specs/out_specs for the state."""
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
    return jax.tree.map(lambda v: v.get_metadata().get(SPEC_KEY, P()), state,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_size(total: int, parts: int, what: str = "features") -> int:
    """total // parts, or a ValueError naming `what` if it does not divide."""
    if parts < 1 or total % parts:
        raise ValueError(f"pk_jax.flax: {what} ({total}) must divide by the number of "
                         f"shards ({parts})")
    return total // parts


def init_sharded(factory: Callable[[], nnx.Module], mesh: Mesh
                 ) -> tuple[nnx.GraphDef, nnx.State]:
    """Build a module on every device of `mesh` (inside a jitted shard_map)
    and return its graphdef and its state as global arrays laid out by
    `partition_specs`.

    Parameters made with this module's layers are drawn at their global
    shape and each device keeps its block, so the global weights do not
    depend on the mesh (the same seed gives the same model on any number of
    devices) and initializers see the global fan-in; each device briefly
    holds one whole parameter while drawing it. The factory must create its
    own `nnx.Rngs` (with a fixed seed) so that every device draws alike.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(factory))
    build = jax.shard_map(lambda: nnx.state(factory()), mesh=mesh, in_specs=(),
                          out_specs=partition_specs(abstract))
    return graphdef, jax.jit(build)()


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def new_param(rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], dtype,
              spec: P) -> nnx.Param:
    """A parameter of local `shape` whose global layout is `spec`.

    Inside shard_map it is drawn at the global shape and this device keeps
    its block (see `init_sharded`); elsewhere (e.g. under nnx.eval_shape) it
    is drawn at the local shape.
    """
    key = rngs.params()
    axes = [_spec_axes(e) for e in spec] + [()] * (len(shape) - len(spec))
    try:
        sizes = [lax.axis_size(a) if a else 1 for a in axes]
    except NameError:  # not inside shard_map: no axis bound
        return nnx.Param(init(key, shape, dtype), **{SPEC_KEY: spec})
    full = init(key, tuple(s * m for s, m in zip(shape, sizes)), dtype)
    starts = [lax.axis_index(a) * s if a else 0 for a, s in zip(axes, shape)]
    return nnx.Param(lax.dynamic_slice(full, starts, shape), **{SPEC_KEY: spec})


def check_positive(**sizes: int) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"pk_jax.flax: {name} must be a positive int, got {size!r}")
