"""Rank tables: which devices form each group of a mesh axis, in rank order.

At lowering time the concrete mesh is known (the lowering context's axis
context), so every group's device ids go into the kernel's attributes as a
static table; at run time a device finds itself in it and learns its rank
and its peers. No host state per call, so the calls are CUDA-graph safe.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax import lax
from jax.sharding import Mesh

from pk_jax import _compat


def axis_names(axis_name: str | Sequence[str], op: str) -> tuple[str, ...]:
    """`axis_name` (a mesh axis name or a tuple of them) as a tuple, each
    name an axis bound where `pk_jax.<op>` is traced: a mesh axis of the
    enclosing `jax.shard_map` (or a vmap's axis_name). Errors name the op:
    no axis or an axis named twice (ValueError), None (TypeError), an
    unbound axis (NameError, JAX's error for it, saying what to do)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"pk_jax.{op}: axis_name must name at least one mesh axis")
    if any(a is None for a in names):
        raise TypeError(f"pk_jax.{op}: axis_name must name a mesh axis (a str, or a tuple of "
                        f"them), got {axis_name!r}; pk_jax.{op} runs inside jax.shard_map over "
                        "a mesh with that axis")
    repeated = sorted({str(a) for a in names if names.count(a) > 1})
    if repeated:
        raise ValueError(f"pk_jax.{op}: axis_name {names} names mesh axis "
                         f"{', '.join(repeated)} more than once; a tuple of axis names must "
                         "name each axis at most once")
    for a in names:
        try:
            lax.axis_size(a)
        except NameError:
            bound = _compat.bound_axis_names()
            here = (f"the axes bound here are {', '.join(map(repr, bound))}" if bound else
                    "no mesh axis is bound here: the call is not inside jax.shard_map")
            raise NameError(f"pk_jax.{op}: axis_name {a!r} is not an axis bound here ({here}); "
                            f"call pk_jax.{op} inside jax.shard_map over a mesh with axis "
                            f"{a!r}") from None
    return names


def axis_groups(mesh: Mesh, names: tuple[str, ...]) -> np.ndarray:
    """Device ids of each group along `names`, shape [num_groups, group_size].

    Column r of a row is the device with `lax.axis_index(names) == r`: for a
    tuple of axes the index is row-major over the axes in the order given.
    """
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis {missing} not in mesh axes {mesh.axis_names}")
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    axes = [mesh.axis_names.index(a) for a in names]
    others = [i for i in range(ids.ndim) if i not in axes]
    size = int(np.prod([ids.shape[i] for i in axes]))
    return np.transpose(ids, others + axes).reshape(-1, size)


def table_key(table: np.ndarray) -> tuple:
    """A hashable identity of a group table: its shape and ids (the ids alone
    do not tell a [1, 8] table from a [2, 4] one)."""
    return (tuple(int(s) for s in table.shape), tuple(int(i) for i in table.reshape(-1)))


def lowering_mesh(ctx, op: str) -> Mesh:
    """The concrete mesh of the shard_map being lowered.

    A shard_map given an abstract mesh (explicit sharding: `jax.shard_map`
    without `mesh=` under `jax.set_mesh`) lowers with the concrete mesh of
    the `jax.set_mesh` context.
    """
    from jax._src import mesh as mesh_lib, sharding_impls  # axis contexts live here

    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if not isinstance(axis_context, sharding_impls.SPMDAxisContext) or mesh is None:
        raise ValueError(
            f"pk_jax.{op} must be called inside jax.shard_map (got axis context "
            f"{type(axis_context).__name__})")
    if isinstance(mesh, Mesh):
        return mesh
    concrete = mesh_lib.get_concrete_mesh()
    if not concrete.empty and concrete.abstract_mesh.shape_tuple == mesh.shape_tuple:
        return concrete
    raise ValueError(
        f"pk_jax.{op}: the shard_map's mesh is abstract ({mesh}) and no concrete mesh is set, "
        "so the devices of each group are unknown; pass the concrete Mesh to "
        "jax.shard_map(mesh=...) or compile under `with jax.set_mesh(mesh):`")
