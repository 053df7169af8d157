"""pk_jax.all_gather: `lax.all_gather` with pk's peer-memory kernels on GPUs.

Validation happens here, once, at trace time: dtypes with no kernel and
mechanism="xla" call `lax.all_gather`; everything else goes to
primitive.gather, which resolves the mechanism and binds the
primitive with one frozen config, lowered to the kernel on CUDA and to
`lax.all_gather` on every other platform.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax import lax

from pk_jax import _args, groups, reference, runtime
from pk_jax._compat import vary_alike
from pk_jax._warnings import warn_once
from pk_jax.ops.all_gather.primitive import KERNEL_MECHANISMS, gather

MECHANISMS = ("auto", *KERNEL_MECHANISMS, "xla")
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
      num_blocks: thread blocks of the ld/st kernels (512 threads each; an
        int 1..2^31 - 1, clamped to what is co-resident, 2 per SM on H200).
        None: one per SM, the best measured on 2 x H200.

    An empty x (a zero-size dimension anywhere, also the gathered one)
    gives the empty result of the right shape; nothing moves.

    Returns:
      The gathered array, identical on every device of the group.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.all_gather: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    if num_blocks is not None:  # the kernels clamp it to the co-resident blocks
        num_blocks = _args.integer("all_gather", "num_blocks", num_blocks, 1, _args.INT32_MAX)
    tiled = _args.boolean("all_gather", "tiled", tiled)
    names = groups.axis_names(axis_name, "all_gather")
    x = jax.numpy.asarray(x)
    if tiled and x.ndim == 0:
        raise ValueError("pk_jax.all_gather: tiled=True needs an input of rank >= 1")
    ndim = x.ndim + (0 if tiled else 1)
    dim = _args.axis("all_gather", "axis", axis, ndim,
                     f"a rank-{x.ndim} input with tiled={tiled}")
    if x.size == 0:  # nothing moves (lax's collective refuses some empty shapes)
        n = lax.axis_size(names)
        shape = list(x.shape)
        if tiled:
            shape[dim] *= n
        else:
            shape.insert(dim, n)
        return vary_alike(jax.numpy.zeros(shape, x.dtype), x, names=names)[0]
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
