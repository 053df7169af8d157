"""Routing of a sharded dot_general: which pk_jax op runs per device, and the
operand and result shardings it needs. Pure Python over per-dim mesh axes,
so the rules can be read (and tested) without compiling anything.

Rules, in order (n = the devices along the axes in question):
  1. Batch dims: the lhs's sharding wins (the rhs's if the lhs's is empty).
  2. Contracting dims: equal on both sides, kept; sharded on one side only,
     unsharded on both (the partitioner gathers it); sharded over different
     axes on the two sides, the lhs's axes win (the rhs is resharded: the
     result stays correct, at the price of that reshard).
  3. Mesh axes A sharding a free dim of the lhs (rows) and a free dim of the
     rhs (output features) at once: `all_gather_matmul` over A when it is
     exactly one such pair of dims, the features sharded over exactly A and
     the rows over (D..., A...) (A the minor axes; the result keeps D on the
     rows), no batch dims and no sharded contraction; otherwise the lhs is
     gathered on those axes first.
  4. Sharded contraction (axes C): `matmul_reduce_scatter` when the wanted
     result has an lhs free dim sharded over (that dim's own axes + C) and no
     batch dims; otherwise `matmul_all_reduce` over C (result replicated over
     C) when the lhs has a free dim and there are no batch dims, else the
     local dot + `psum` over C ("all_reduce").
  5. Else the local dot ("local"): every dim keeps its operand's sharding.
The fused ops take floating-point, non-empty operands; other dtypes or
empty arrays use the all_reduce (dot + psum) / local routes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pk_jax.partitioning._specs import Axes, axes_size, dedupe


@dataclasses.dataclass(frozen=True)
class DotDims:
    """A dot_general's static layout, normalized (hashable).

    The op computes `transpose(lax.dot_general(lhs, rhs, dims), out_perm)`:
    out_perm lets the gradient ops produce their operand's layout directly.
    """

    lhs_ndim: int
    rhs_ndim: int
    lc: tuple[int, ...]  # lhs contracting dims
    rc: tuple[int, ...]
    lb: tuple[int, ...]  # lhs batch dims
    rb: tuple[int, ...]
    out_perm: tuple[int, ...]

    @property
    def lf(self) -> tuple[int, ...]:
        """lhs free dims (rows), in order."""
        return tuple(d for d in range(self.lhs_ndim) if d not in self.lc + self.lb)

    @property
    def rf(self) -> tuple[int, ...]:
        """rhs free dims (output features), in order."""
        return tuple(d for d in range(self.rhs_ndim) if d not in self.rc + self.rb)

    @property
    def dimension_numbers(self):
        return ((self.lc, self.rc), (self.lb, self.rb))


@dataclasses.dataclass(frozen=True)
class DotPlan:
    """What the partition callback runs: the route, its collective's axes,
    the operand and result per-dim axes (result in out_perm order) and, for
    the fused routes, the lhs free dim gathered / scattered."""

    route: str
    axes: Axes
    lhs: tuple[Axes, ...]
    rhs: tuple[Axes, ...]
    out: tuple[Axes, ...]
    lhs_dim: int = -1


def _flat(dims: Sequence[Axes]) -> Axes:
    return tuple(a for d in dims for a in d)


def plan_dot(dims: DotDims, lhs: Sequence[Axes], rhs: Sequence[Axes],
             want: Optional[Sequence[Axes]], sizes: dict, lhs_shape: Sequence[int],
             fusable: bool) -> DotPlan:
    """Route one dot_general.

    Args:
      dims: the layout.
      lhs, rhs: per-dim mesh axes of the operands as given.
      want: per-dim axes of the result the program wants (out_perm order),
        or None when unknown.
      sizes: mesh axis sizes.
      lhs_shape: the lhs's global shape.
      fusable: whether the fused pk ops can take these operands at all.
    """
    L, R = list(lhs), list(rhs)
    for i, j in zip(dims.lb, dims.rb):  # rule 1
        L[i] = R[j] = L[i] or R[j]
    for i, j in zip(dims.lc, dims.rc):  # rule 2
        if L[i] != R[j]:
            L[i] = R[j] = L[i] if (L[i] and R[j]) else ()
    lf, rf = dims.lf, dims.rf
    L = dedupe(L, dims.lb + dims.lc + lf)
    R = dedupe(R, dims.rb + dims.rc + rf)
    contraction = _flat([L[i] for i in dims.lc])

    def result(lhs_free: dict[int, Axes]) -> tuple[Axes, ...]:
        dot_order = [L[i] for i in dims.lb] + [lhs_free.get(i, L[i]) for i in lf] \
            + [R[j] for j in rf]
        return tuple(dot_order[k] for k in dims.out_perm)

    def done(route, axes=(), lhs_dim=-1, lhs_free=None) -> DotPlan:
        return DotPlan(route, tuple(axes), tuple(L), tuple(R), result(lhs_free or {}), lhs_dim)

    shared = set(_flat([L[i] for i in lf])) & set(_flat([R[j] for j in rf]))
    if shared:  # rule 3
        pairs = [(i, j) for i in lf for j in rf
                 if set(L[i]) & shared and set(R[j]) & shared]
        if fusable and not dims.lb and not contraction and len(pairs) == 1:
            i, j = pairs[0]
            gathered, kept = R[j], L[i][:len(L[i]) - len(R[j])]
            # the gathered axes must be the minor ones of the rows' axes, so
            # that gathering them leaves this device the rows of `kept`
            if set(gathered) == shared and L[i] == kept + gathered:
                return done("all_gather_matmul", gathered, i, {i: kept})
        for i in lf:
            L[i] = tuple(a for a in L[i] if a not in shared)
    if contraction:  # rule 4
        n = axes_size(sizes, contraction)
        if fusable and not dims.lb and want is not None:
            want_dot = [()] * len(dims.out_perm)
            for k, p in enumerate(dims.out_perm):
                want_dot[p] = tuple(want[k])
            nb = len(dims.lb)
            for t, i in enumerate(lf):
                local = lhs_shape[i] // axes_size(sizes, L[i])
                if want_dot[nb + t] == L[i] + contraction and local % n == 0:
                    return done("matmul_reduce_scatter", contraction, i,
                                {i: L[i] + contraction})
        if fusable and not dims.lb and lf:
            return done("matmul_all_reduce", contraction, lf[0])
        return done("all_reduce", contraction)
    return done("local")
