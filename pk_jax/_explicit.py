"""Explicit sharding (`AxisType.Explicit`, `jax.make_mesh`'s default): arrays
carry their sharding in their type, so a partitioned op must give its result
a legal sharding when it is traced, not only when XLA partitions it.

The partitioned ops route from the types at trace time with the same plans
as the partition callbacks, and their trace-time function (what
`custom_partitioning` uses for the result's type, and runs when nothing is
partitioned) computes on replicated operands and returns the planned
sharding; the partition callback then runs the fused op.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def explicit_mesh(*xs: jax.Array):
    """The (abstract) mesh of the first operand whose type has Explicit mesh
    axes, or None when every operand is unsharded or Auto-sharded."""
    for x in xs:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        types = getattr(mesh, "axis_types", ())
        if any(t == AxisType.Explicit for t in types):
            return mesh
    return None


def type_sharding(x: jax.Array) -> Optional[NamedSharding]:
    """The NamedSharding in `x`'s type (None when it has none)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def reshard(x: jax.Array, mesh, spec: P) -> jax.Array:
    """`x` with sharding `spec` on `mesh` (a no-op when it has it already)."""
    current = type_sharding(x)
    if current is not None and tuple(current.spec) == tuple(spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def replicated_fun(fun: Callable, out_specs: Any) -> Callable:
    """`fun` on replicated operands, its results resharded to `out_specs`
    (one spec, or a tuple for several results): the trace-time function of a
    partitioned op under explicit sharding."""

    def run(*args):
        mesh = explicit_mesh(*args)
        out = fun(*(reshard(a, mesh, P()) for a in args))
        if isinstance(out_specs, P):
            return reshard(out, mesh, out_specs)
        return tuple(reshard(o, mesh, s) for o, s in zip(out, out_specs))

    return run


def spec_of(sharding) -> Optional[P]:
    """The PartitionSpec of an `out_sharding=` argument (a NamedSharding or a
    PartitionSpec), or None."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, P):
        return sharding
    raise TypeError(f"pk_jax: out_sharding must be a NamedSharding or a PartitionSpec, got "
                    f"{type(sharding).__name__}")
