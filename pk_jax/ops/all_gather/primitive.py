"""The primitive of `pk_jax.all_gather`.

`pk_all_gather`: x (this rank's shard) -> the gathered array, with the
static `AllGatherConfig` (mechanism already resolved). Linear: its JVP is
itself and its transpose is `psum_scatter`, so jax.grad and jax.jvp work on
every path. Lowering: on CUDA with the extension built, the FFI kernel of
xla_ffi/all_gather.cc; on any other platform `lax.all_gather`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from pk_jax import reference, runtime, tuning
from pk_jax._compat import make_varying, result_aval
from pk_jax.ops._lowering import channel_attr, kernel_group, spans_processes

ZERO_COPY = ("ld_st_push", "ld_st_pull")  # publish raw buffer addresses

# The kernel mechanisms, in the order pk_jax.all_gather lists them (its
# MECHANISMS: "auto", these, "xla"), and their ids in the FFI attribute
# `mechanism` (csrc/kernels/all_gather/all_gather.h: Mechanism).
KERNEL_MECHANISMS = {"ld_st_ll": 3, "ld_st_push": 2, "ld_st_pull": 0, "copy_engine": 1}


@dataclasses.dataclass(frozen=True)
class AllGatherConfig:
    """Static part of one call, validated once.

    Attributes:
      names: the mesh axes gathered over.
      n: the group size.
      dim: where the gathered axis goes (normalized).
      tiled: concatenate along `dim` instead of stacking a new axis.
      mechanism: a key of KERNEL_MECHANISMS.
      forced: the user asked for `mechanism` (else "auto" chose it).
      num_blocks: grid of the ld/st kernels; 0: one block per SM.
    """

    names: tuple[str, ...]
    n: int
    dim: int
    tiled: bool
    mechanism: str
    forced: bool = False
    num_blocks: int = 0


all_gather_p = Primitive("pk_all_gather")


def layout(shape: tuple[int, ...], dim: int, itemsize: int) -> tuple[int, int]:
    """(rows, row_bytes) of the kernel's view: every rank's block is `rows`
    rows of `row_bytes` bytes, interleaved by rank in the output. Stacked and
    tiled gathers share it."""
    rows = int(np.prod(shape[:dim], dtype=np.int64))
    row_bytes = int(np.prod(shape[dim:], dtype=np.int64)) * itemsize
    return rows, row_bytes


def resolve_mechanism(mechanism: str, per_rank: int, row_bytes: int) -> str:
    """The kernel mechanism of one call (`auto` from pk_jax/tuning.py)."""
    ll_ok = per_rank <= runtime.LL_MAX_BYTES and row_bytes % 4 == 0
    if mechanism == "auto":
        return tuning.all_gather_mechanism(ll_ok)
    if mechanism == "ld_st_ll" and not ll_ok:
        raise ValueError(
            f"pk_jax.all_gather(mechanism='ld_st_ll') takes messages of up to "
            f"{runtime.LL_MAX_BYTES} bytes per rank made of whole 4-byte words (got "
            f"{per_rank} bytes, rows of {row_bytes}); use 'ld_st_push'")
    return mechanism


def gather(x, names: tuple[str, ...], dim: int, tiled: bool, mechanism: str = "auto",
           num_blocks: int = 0):
    """The primitive bound on `x` (a dtype with a kernel; dim already
    normalized), made varying over `names`, with the mechanism resolved for
    this call. pk_jax.all_gather calls it once its arguments are checked, and
    so does reduce_scatter's transpose (all_reduce/primitive.py)."""
    rows, row_bytes = layout(x.shape, dim, np.dtype(x.dtype).itemsize)
    chosen = resolve_mechanism(mechanism, rows * row_bytes, row_bytes)
    assert chosen in KERNEL_MECHANISMS, chosen
    cfg = AllGatherConfig(names, lax.axis_size(names), dim, tiled, chosen,
                          mechanism != "auto", num_blocks)
    return all_gather_p.bind(make_varying(x, names), cfg=cfg)


def _abstract_eval(x, *, cfg: AllGatherConfig):
    out = list(x.shape)
    if cfg.tiled:
        out[cfg.dim] *= cfg.n
    else:
        out.insert(cfg.dim, cfg.n)
    return result_aval(x, tuple(out))


def _transpose(ct, x, *, cfg: AllGatherConfig):
    return [lax.psum_scatter(ct, cfg.names, scatter_dimension=cfg.dim, tiled=cfg.tiled)]


def _reference_lowering(ctx, x, *, cfg: AllGatherConfig):
    fn = lambda v: reference.all_gather(v, cfg.names, axis=cfg.dim, tiled=cfg.tiled)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _cuda_lowering(ctx, x, *, cfg: AllGatherConfig):
    forced = cfg.mechanism if cfg.forced else None
    table = kernel_group(ctx, "all_gather", cfg.names, cfg.n, forced=forced)
    if table is None:
        return _reference_lowering(ctx, x, cfg=cfg)
    mechanism = cfg.mechanism
    if mechanism in ZERO_COPY and spans_processes(table):
        # A buffer address means nothing in another process: stage instead.
        if forced:
            raise ValueError(f"pk_jax.all_gather(mechanism={forced!r}) reads and writes the "
                             f"peers' buffers directly, but the groups of axis {cfg.names} span "
                             "processes; use 'auto', 'copy_engine' or 'ld_st_ll'")
        mechanism = "copy_engine"
    x_aval, = ctx.avals_in
    rows, row_bytes = layout(x_aval.shape, cfg.dim, np.dtype(x_aval.dtype).itemsize)
    staged = cfg.n * rows * row_bytes if mechanism == "copy_engine" else 0
    attr = channel_attr(table, "all_gather", mechanism, staged, ll=mechanism == "ld_st_ll")
    return jax.ffi.ffi_lowering("pk_all_gather")(
        ctx, x, rows=np.int64(rows), row_bytes=np.int64(row_bytes),
        mechanism=np.int32(KERNEL_MECHANISMS[mechanism]),
        num_blocks=np.int32(cfg.num_blocks), **attr)


all_gather_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(all_gather_p, _transpose)
mlir.register_lowering(all_gather_p, _reference_lowering)
mlir.register_lowering(all_gather_p, _cuda_lowering, platform="cuda")
