"""pk_jax.all_gather: `lax.all_gather` with pk's peer-memory kernels on GPUs.

Validation happens here, once, at trace time: dtypes with no kernel and
mechanism="xla" call `lax.all_gather`; everything else goes to
all_gather_primitive.gather, which resolves the mechanism and binds the
primitive with one frozen config, lowered to the kernel on CUDA and to
`lax.all_gather` on every other platform.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from pk_jax import groups, reference, runtime
from pk_jax._warnings import warn_once
from pk_jax.ops.all_gather_primitive import gather

MECHANISMS = ("auto", "ld_st_ll", "ld_st_push", "ld_st_pull", "copy_engine", "xla")
_KERNEL_ITEMSIZES = (1, 2, 4, 8)


def all_gather(x: jax.Array, axis_name: str | Sequence[str], *, axis: int = 0,
               tiled: bool = False, mechanism: str = "auto",
               num_blocks: int | None = None) -> jax.Array:
    """Gather `x` from every device of `axis_name`; same semantics as
    `jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)`.

    Call inside `jax.shard_map`. On CUDA GPUs the data moves through pk_jax
    kernels that read and write peer GPUs' memory directly; elsewhere XLA's
    collective runs.

    Args:
      x: this device's shard. Any dtype of 1, 2, 4 or 8 bytes takes the
        kernel path; others fall back to XLA with a one-time warning.
      axis_name: mesh axis name, or tuple of names, to gather over (a tuple
        is gathered in row-major order of the axes as given, like
        `lax.all_gather`).
      axis: where the gathered axis goes (tiled=False: a new axis at this
        position; tiled=True: an existing axis that grows n-fold).
      tiled: concatenate along `axis` instead of stacking a new axis.
      mechanism: "auto" (pk_jax/tuning.py: "ld_st_ll" up to 16 KiB per rank,
        "ld_st_push" above); "ld_st_ll" (data and flags travel together as
        8-byte lines into the peers' workspaces: one one-way trip per call;
        up to 16 KiB per rank of whole 4-byte words); "ld_st_push" (an SM
        kernel writes this rank's block into every peer's output with
        16-byte stores, zero copy); "ld_st_pull" (the same kernel reads every
        peer's input instead); "copy_engine" (DMA engines move the data, no
        SMs; stages n blocks in the workspace; one copy per row of the
        output layout, so slow for gathers along a later axis of many rows);
        or "xla" (lax.all_gather).
      num_blocks: thread blocks of the ld/st kernels (512 threads each; at most
        what is co-resident, 2 per SM on H200). None: one per SM, the best
        measured on 2 x H200.

    Returns:
      The gathered array, identical on every device of the group.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.all_gather: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool)
                                   or not isinstance(num_blocks, (int, np.integer))
                                   or num_blocks < 1):
        raise ValueError(f"pk_jax.all_gather: num_blocks must be a positive int or None, got "
                         f"{num_blocks!r}")
    names = groups.axis_names(axis_name)
    x = jax.numpy.asarray(x)
    ndim = x.ndim + (0 if tiled else 1)
    if not -ndim <= axis < ndim:
        raise ValueError(f"pk_jax.all_gather: axis={axis} out of range for a rank-{x.ndim} "
                         f"input with tiled={tiled} (valid: {-ndim}..{ndim - 1})")
    if tiled and x.ndim == 0:
        raise ValueError("pk_jax.all_gather: tiled=True needs an input of rank >= 1")
    dim = axis % ndim
    if mechanism == "xla":
        return reference.all_gather(x, names, axis=dim, tiled=tiled)
    itemsize = np.dtype(x.dtype).itemsize
    if itemsize not in _KERNEL_ITEMSIZES or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        why = (f"dtype {x.dtype} ({itemsize} bytes) has no kernel (supported: dtypes of "
               f"{_KERNEL_ITEMSIZES} bytes)")
        if mechanism != "auto":
            raise ValueError(f"pk_jax.all_gather(mechanism={mechanism!r}): {why}; use 'auto' "
                             "or 'xla'")
        if runtime.available():  # elsewhere the reference is the plan, not a fallback
            warn_once(f"all_gather-dtype-{x.dtype}",
                      f"pk_jax.all_gather: {why}; using lax.all_gather")
        return reference.all_gather(x, names, axis=dim, tiled=tiled)
    return gather(x, names, dim, bool(tiled), mechanism, int(num_blocks or 0))
