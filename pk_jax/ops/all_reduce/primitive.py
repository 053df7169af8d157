"""The primitive of `pk_jax.all_reduce` and `pk_jax.reduce_scatter`.

`pk_all_reduce`: x -> the sum over the group (kind "all_reduce", the shape
of x) or this rank's chunk of it (kind "reduce_scatter", `lax.psum_scatter`'s
shape), with the static `AllReduceConfig` (mechanism already resolved).
Linear, with `lax.psum`'s / `lax.psum_scatter`'s transposes, so jax.grad,
jax.jvp and jax.linear_transpose match lax on every path. Lowering: on CUDA
with the extension built, the FFI call of xla_ffi/all_reduce.cc; on any
other platform `lax.psum` / `lax.psum_scatter`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from pk_jax import reference
from pk_jax._compat import make_varying, result_aval
from pk_jax.ops._lowering import channel_attr, kernel_group
from pk_jax.ops.all_gather.primitive import gather

# The kernel mechanisms, in the order pk_jax.all_reduce lists them (its
# MECHANISMS: "auto", these, "xla"), and their ids in the FFI attribute
# `mechanism` (csrc/kernels/all_reduce/all_reduce.h: Mechanism).
KERNEL_MECHANISMS = {"one_shot": 0, "two_shot": 1, "copy_engine": 2}
# FFI attribute `kind` (all_reduce.h: Kind).
KINDS = {"all_reduce": 0, "reduce_scatter": 1}
# Staged chunks start on 16-byte boundaries (all_reduce.h: Geometry).
_CHUNK_ALIGN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    """Static part of one call, validated once.

    Attributes:
      kind: "all_reduce" (lax.psum) or "reduce_scatter" (lax.psum_scatter).
      names: the mesh axes summed over.
      n: the group size.
      mechanism: a key of KERNEL_MECHANISMS.
      forced: the user asked for `mechanism` (else "auto" chose it).
      scatter_dimension, tiled: reduce_scatter's (normalized).
      check_vma: whether shard_map's varying-axes types were on when the
        call was traced: lax.psum's transpose depends on it (below).
    """

    kind: str
    names: tuple[str, ...]
    n: int
    mechanism: str
    forced: bool = False
    scatter_dimension: int = 0
    tiled: bool = True
    check_vma: bool = True


all_reduce_p = Primitive("pk_all_reduce")


def geometry(cfg: AllReduceConfig, shape: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
    """(rows, stride, chunk) of the kernels' view (all_reduce.h: Geometry):
    x is `rows` rows of `stride` elements, chunk c the elements
    [c chunk, (c + 1) chunk) of every row (clamped to the row)."""
    if cfg.kind == "all_reduce":
        count = int(np.prod(shape, dtype=np.int64))
        align = max(1, _CHUNK_ALIGN_BYTES // itemsize)
        per_rank = -(-count // cfg.n)
        return 1, count, -(-per_rank // align) * align
    d = cfg.scatter_dimension
    rows = int(np.prod(shape[:d], dtype=np.int64))
    stride = int(np.prod(shape[d:], dtype=np.int64))
    return rows, stride, stride // cfg.n


def staged_bytes(cfg: AllReduceConfig, shape, itemsize: int) -> tuple[int, int]:
    """Bytes of region of each phase (all_reduce.h: phase1_bytes, phase2_bytes)."""
    rows, stride, chunk = geometry(cfg, shape, itemsize)
    if cfg.kind == "all_reduce" and cfg.mechanism == "one_shot":
        return cfg.n * -(-rows * stride * itemsize // 16) * 16, 0  # slots of 16-byte multiples
    second = cfg.n * chunk * itemsize if cfg.kind == "all_reduce" else 0
    return cfg.n * rows * chunk * itemsize, second


def _with_varying(aval, vma):
    """`aval` with the varying mesh axes `vma` (spelled differently by JAX versions)."""
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return aval.update(manual_axis_type=mat.update(varying=frozenset(vma)))
    if hasattr(aval, "vma"):
        return aval.update(vma=frozenset(vma))
    return aval


def _abstract_eval(x, *, cfg: AllReduceConfig):
    if cfg.kind == "all_reduce":
        # psum: varying -> invariant over the summed axes.
        return _with_varying(x, varying_axes_of(x) - set(cfg.names))
    out = list(x.shape)
    d = cfg.scatter_dimension
    if cfg.tiled:
        out[d] //= cfg.n
    else:
        del out[d]
    return result_aval(x, tuple(out))


def varying_axes_of(aval) -> frozenset:
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "mat", None)
        vma = getattr(mat, "varying", ()) if mat is not None else ()
    return frozenset(vma)


def _transpose(ct, x, *, cfg: AllReduceConfig):
    if cfg.kind == "reduce_scatter":
        # lax.psum_scatter's transpose: all_gather of the cotangent.
        return [gather(ct, cfg.names, cfg.scatter_dimension, cfg.tiled)]
    if cfg.check_vma:
        # psum_invariant's transpose: the invariant cotangent, cast to varying.
        return [make_varying(ct, cfg.names)]
    # Unchecked psum's transpose is psum of the cotangent.
    return [all_reduce_p.bind(ct, cfg=cfg)]


def _reference(v, cfg: AllReduceConfig):
    if cfg.kind == "all_reduce":
        return reference.all_reduce(v, cfg.names)
    return reference.reduce_scatter(v, cfg.names, scatter_dimension=cfg.scatter_dimension,
                                    tiled=cfg.tiled)


def _reference_lowering(ctx, x, *, cfg: AllReduceConfig):
    return mlir.lower_fun(lambda v: _reference(v, cfg), multiple_results=False)(ctx, x)


def _cuda_lowering(ctx, x, *, cfg: AllReduceConfig):
    forced = cfg.mechanism if cfg.forced else None
    table = kernel_group(ctx, cfg.kind, cfg.names, cfg.n, forced=forced)
    if table is None:
        return _reference_lowering(ctx, x, cfg=cfg)
    x_aval, = ctx.avals_in
    itemsize = np.dtype(x_aval.dtype).itemsize
    rows, stride, chunk = geometry(cfg, x_aval.shape, itemsize)
    first, second = staged_bytes(cfg, x_aval.shape, itemsize)
    attr = channel_attr(table, cfg.kind, (cfg.mechanism, "phase1"), first)["channel"]
    two_phases = cfg.kind == "all_reduce" and cfg.mechanism != "one_shot"
    attr2 = (channel_attr(table, cfg.kind, (cfg.mechanism, "phase2"), second)["channel"]
             if two_phases else attr)
    return jax.ffi.ffi_lowering("pk_all_reduce")(
        ctx, x, channel=attr, channel2=attr2, kind=np.int32(KINDS[cfg.kind]),
        mechanism=np.int32(KERNEL_MECHANISMS[cfg.mechanism]), rows=np.int64(rows),
        stride=np.int64(stride), chunk=np.int64(chunk))


all_reduce_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(all_reduce_p, _transpose)
mlir.register_lowering(all_reduce_p, _reference_lowering)
mlir.register_lowering(all_reduce_p, _cuda_lowering, platform="cuda")
