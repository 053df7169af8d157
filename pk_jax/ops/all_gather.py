"""pk_jax.all_gather: `lax.all_gather` with pk's peer-memory kernels on GPUs.

Path choice:
  * trace time: unsupported dtypes and mechanism="xla" call lax.all_gather.
  * lowering: on CUDA with the extension built, the FFI kernel; on any other
    platform the same primitive lowers to lax.all_gather.
The primitive is linear: its JVP is itself and its transpose is psum_scatter,
so jax.grad and jax.jvp work on every path.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from pk_jax import groups, reference, runtime, tuning
from pk_jax._compat import make_varying
from pk_jax._warnings import warn_once
from pk_jax.ops._lowering import channel_attrs, group_table, kernels_missing

MECHANISMS = ("auto", "ld_st_ll", "ld_st_push", "ld_st_pull", "copy_engine", "xla")
# Ids of the "mechanism" FFI attribute (xla_ffi/all_gather.cc: Mechanism).
_MECHANISM_IDS = {"ld_st_pull": 0, "copy_engine": 1, "ld_st_push": 2, "ld_st_ll": 3}
_KERNEL_ITEMSIZES = (1, 2, 4, 8)
_TARGET = "pk_all_gather"

all_gather_p = Primitive("pk_all_gather")


def all_gather(x: jax.Array, axis_name: str | Sequence[str], *, axis: int = 0,
               tiled: bool = False, mechanism: str = "auto",
               num_blocks: int | None = None) -> jax.Array:
    """Gather `x` from every device of `axis_name`; same semantics as
    `jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)`.

    Call inside `jax.shard_map`. On CUDA GPUs the data moves through pk_jax
    kernels that read peer GPUs' memory directly; elsewhere XLA's collective
    runs.

    Args:
      x: this device's shard. Any dtype of 1, 2, 4 or 8 bytes takes the
        kernel path; others fall back to XLA with a one-time warning.
      axis_name: mesh axis name, or tuple of names, to gather over.
      axis: where the gathered axis goes (tiled=False: a new axis at this
        position; tiled=True: an existing axis that grows n-fold).
      tiled: concatenate along `axis` instead of stacking a new axis.
      mechanism: "auto" (a measured table picks by size); "ld_st_ll" (small
        messages, up to 16 KiB per rank: data and flags travel together into
        the peers' workspaces, one one-way trip per call); "ld_st_push" (an SM
        kernel writes this rank's block into every peer's output with 16-byte
        stores, zero copy); "ld_st_pull" (the same kernel reads every peer's
        input instead); "copy_engine" (DMA engines move the data, no SMs;
        stages through the workspace; one copy per row of the output layout,
        so slow for gathers along a later axis of many rows); or "xla"
        (lax.all_gather).
      num_blocks: thread blocks of the ld/st kernels (512 threads each; at most
        what is co-resident, 2 per SM on H200). None: one per SM, the best
        measured on 2 x H200.

    Returns:
      The gathered array, identical on every device of the group.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
    names = groups.axis_names(axis_name)
    x = jax.numpy.asarray(x)
    ndim = x.ndim + (0 if tiled else 1)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} out of range for a rank-{x.ndim} input with "
                         f"tiled={tiled} (valid: {-ndim}..{ndim - 1})")
    if tiled and x.ndim == 0:
        raise ValueError("tiled=True needs an input of rank >= 1")
    dim = axis % ndim
    if mechanism == "xla":
        return reference.all_gather(x, names, axis=dim, tiled=tiled)
    itemsize = np.dtype(x.dtype).itemsize
    if itemsize not in _KERNEL_ITEMSIZES or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        warn_once(f"all_gather-dtype-{x.dtype}",
                  f"pk_jax.all_gather: dtype {x.dtype} ({itemsize} bytes) has no kernel "
                  f"(supported: dtypes of {_KERNEL_ITEMSIZES} bytes); using lax.all_gather")
        return reference.all_gather(x, names, axis=dim, tiled=tiled)
    n = lax.axis_size(names)
    x = make_varying(x, names)
    return all_gather_p.bind(x, names=names, dim=dim, tiled=tiled, n=n, mechanism=mechanism,
                             num_blocks=num_blocks or 0)


def _out_shape(shape: tuple[int, ...], dim: int, tiled: bool, n: int) -> tuple[int, ...]:
    out = list(shape)
    if tiled:
        out[dim] *= n
    else:
        out.insert(dim, n)
    return tuple(out)


def _abstract_eval(x, *, dim, tiled, n, **_):
    return x.update(shape=_out_shape(x.shape, dim, tiled, n))


def _transpose(ct, x, *, names, dim, tiled, **_):
    return [lax.psum_scatter(ct, names, scatter_dimension=dim, tiled=tiled)]


def _reference_lowering(ctx, x, *, names, dim, tiled, **_):
    fn = lambda v: reference.all_gather(v, names, axis=dim, tiled=tiled)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _layout(shape: tuple[int, ...], dim: int, itemsize: int) -> tuple[int, int]:
    """(rows, row_bytes) of the kernel's view: every rank's block is `rows`
    rows of `row_bytes` bytes, interleaved by rank in the output."""
    rows = int(np.prod(shape[:dim], dtype=np.int64))
    row_bytes = int(np.prod(shape[dim:], dtype=np.int64)) * itemsize
    return rows, row_bytes


def _resolve_mechanism(mechanism: str, rows: int, row_bytes: int, n: int, ext) -> str:
    per_rank = rows * row_bytes
    workspace = runtime.workspace_data_bytes()
    ll_ok = per_rank <= ext.ll_max_bytes and row_bytes % 4 == 0
    if mechanism == "auto":
        return tuning.all_gather_mechanism(per_rank, n, workspace, ll_ok)
    if mechanism == "ld_st_ll" and not ll_ok:
        raise ValueError(
            f"pk_jax.all_gather(mechanism='ld_st_ll') takes messages of up to "
            f"{ext.ll_max_bytes} bytes per rank made of whole 4-byte words (got {per_rank} "
            f"bytes, rows of {row_bytes}); use 'ld_st_push'")
    return mechanism


def _channel(mechanism: str, requested: str, table: np.ndarray, rows: int, row_bytes: int,
             n: int, ext) -> tuple[str, "runtime.Channel"]:
    """The workspace channel (and the mechanism, which falls back from
    ld_st_ll to ld_st_push under "auto" when the channel has no LL lines)."""
    staged = n * rows * row_bytes if mechanism == "copy_engine" else 0
    ch = runtime.channel(("all_gather", table.tobytes()), staged)
    if mechanism == "ld_st_ll" and ch.slot >= ext.ll_channels:
        if requested != "auto":
            raise ValueError(f"pk_jax.all_gather: the program uses more than "
                             f"{ext.ll_channels} channels, the number with low-latency "
                             "lines; use mechanism='ld_st_push'")
        mechanism = "ld_st_push"
    return mechanism, ch


def _cuda_lowering(ctx, x, *, names, dim, tiled, n, mechanism, num_blocks):
    if kernels_missing("all_gather"):
        return _reference_lowering(ctx, x, names=names, dim=dim, tiled=tiled)
    x_aval, = ctx.avals_in
    # Stacked and tiled gathers share one byte layout (see _layout).
    rows, row_bytes = _layout(x_aval.shape, dim, np.dtype(x_aval.dtype).itemsize)
    ext, table = group_table(ctx, "all_gather", names, n)
    chosen = _resolve_mechanism(mechanism, rows, row_bytes, n, ext)
    chosen, ch = _channel(chosen, mechanism, table, rows, row_bytes, n, ext)
    return jax.ffi.ffi_lowering(_TARGET)(
        ctx, x, rows=np.int64(rows), row_bytes=np.int64(row_bytes),
        mechanism=np.int32(_MECHANISM_IDS[chosen]), num_blocks=np.int32(num_blocks),
        **channel_attrs(table, ch))


all_gather_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(all_gather_p, _transpose)
mlir.register_lowering(all_gather_p, _reference_lowering)
mlir.register_lowering(all_gather_p, _cuda_lowering, platform="cuda")
