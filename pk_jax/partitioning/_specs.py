"""Sharding bookkeeping shared by the partitioned ops: per-dimension mesh
axes of a `NamedSharding`, and the record of each routing decision.

A partition callback runs while XLA compiles (once per compilation, never on
a cache hit); every decision it makes is appended to the lists of the active
`record_routes()` contexts, which is how tests and users can see which pk_jax
op a plain-jit program was routed to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Sequence

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]  # the mesh axes one array dimension is sharded over


@dataclasses.dataclass(frozen=True)
class Route:
    """One decision of a partition callback.

    Attributes:
      op: "dot_general", "dot_general_transpose" (a gradient), "attention"
        or "attention_vjp".
      route: what runs per device: "all_gather_matmul",
        "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce" (local
        dot + psum: operands matmul_all_reduce does not take), "local"
        (no communication inside the op), "ring_attention" or "attention".
      axes: the mesh axes of the fused collective (empty for "local").
      in_specs: the partition specs the operands are given (the partitioner
        reshards them to these first when they differ from their producers).
      out_specs: the partition specs of the results.
    """

    op: str
    route: str
    axes: Axes
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]


_lock = threading.Lock()
_recorders: list[list[Route]] = []


@contextlib.contextmanager
def record_routes() -> Iterator[list[Route]]:
    """Collect the routing decisions of every compilation inside the block.

    Decisions are made while XLA compiles, so compile inside the block (e.g.
    `jax.jit(f).lower(*args).compile()`); a cached executable does not call
    the partition callbacks again (`jax.clear_caches()` forces it).
    """
    routes: list[Route] = []
    with _lock:
        _recorders.append(routes)
    try:
        yield routes
    finally:
        with _lock:
            _recorders.remove(routes)


def record(route: Route) -> None:
    """Append one decision to every active recorder."""
    with _lock:
        for routes in _recorders:
            routes.append(route)


def dim_axes(sharding, ndim: int, mesh: Mesh) -> list[Axes]:
    """Mesh axes of each of `ndim` dims (axes of size 1 dropped: they shard
    nothing). Shardings that are not `NamedSharding`s count as replicated."""
    if not isinstance(sharding, NamedSharding):
        return [()] * ndim
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for entry in spec[:ndim]:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(a for a in names if mesh.shape[a] > 1))
    return out


def axes_size(sizes: dict, axes: Sequence[str]) -> int:
    """Number of devices along `axes` (sizes: mesh axis name -> size)."""
    size = 1
    for a in axes:
        size *= sizes[a]
    return size


def spec(axes: Sequence[Axes]) -> P:
    """The PartitionSpec of per-dim axes."""
    return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes])


def named(mesh: Mesh, axes: Sequence[Axes]) -> NamedSharding:
    return NamedSharding(mesh, spec(axes))


def dedupe(dims: list[Axes], order: Sequence[int]) -> list[Axes]:
    """Drop repeated mesh axes within one array: the dims in `order` keep
    theirs first (a mesh axis can shard only one dim of an array)."""
    seen: set[str] = set()
    out = list(dims)
    for i in order:
        out[i] = tuple(a for a in dims[i] if a not in seen)
        seen.update(out[i])
    return out
