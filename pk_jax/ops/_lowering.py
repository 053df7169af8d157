"""What every pk_jax kernel lowering shares: whether the kernel can run for
the axis being lowered (else the reference path, or an error when the
mechanism was forced), the rank table of the axis, and the channel attribute
that every collective handler takes (xla_ffi/ffi_common.h: ChannelAttrs)."""

from __future__ import annotations

import functools
from typing import Hashable, Optional

import jax
import numpy as np

from pk_jax import _cluster, groups, runtime
from pk_jax._warnings import warn_once
from pk_jax.config import get_config
from pk_jax.errors import PkJaxError


def _refuse(op: str, forced: Optional[str], why: str) -> None:
    """Warn once (the op takes its reference path), or raise when the user
    forced a kernel mechanism."""
    if forced:
        raise ValueError(f"pk_jax.{op}(mechanism={forced!r}) cannot run its kernel here: {why}; "
                         "use mechanism='auto' (XLA's collectives where the kernel cannot run) "
                         "or 'xla'")
    warn_once(f"{op}-{why}", f"pk_jax.{op}: {why}; using the XLA reference path")


def kernels_missing(op: str, need_cutlass: bool = False, forced: Optional[str] = None) -> bool:
    """True (after a one-time warning, or an error when `forced` names a
    mechanism the user asked for) when this process cannot run the kernel."""
    why = None
    if not runtime.available():
        why = f"the native kernels are unavailable ({runtime.extension_error()})"
    elif need_cutlass and not runtime.extension().has_gemm:
        why = ("the extension was built without CUTLASS (pip install nvidia-cutlass, then "
               "reinstall pk_jax)")
    else:
        try:
            runtime.ensure_ready()
        except PkJaxError as e:
            why = str(e)
    if why is None:
        return False
    _refuse(op, forced, why)
    return True


def kernel_group(ctx, op: str, names: tuple[str, ...], n: int, *, need_cutlass: bool = False,
                 forced: Optional[str] = None) -> Optional[np.ndarray]:
    """The [groups, n] device-id table of the axis when the kernel can run on
    it (peer access set up), else None after a one-time warning (the caller
    lowers the reference), or a ValueError naming the axis when `forced`."""
    if kernels_missing(op, need_cutlass, forced):
        return None
    table = groups.axis_groups(groups.lowering_mesh(ctx, op), names)
    if table.shape[1] != n:
        raise AssertionError(f"mesh group size {table.shape[1]} != axis size {n}")
    if n > runtime.MAX_RANKS:
        _refuse(op, forced, f"groups of up to {runtime.MAX_RANKS} GPUs, the axis {names} has {n}")
        return None
    why = runtime.group_problem(table)
    if why is not None:
        _refuse(op, forced, f"the axis {names}: {why}")
        return None
    runtime.connect(table)
    return table


def spans_processes(table: np.ndarray) -> bool:
    """Whether a group of `table` holds devices of several processes (the
    kernels then exchange data through the shared workspaces only: raw
    buffer addresses mean nothing in another process)."""
    devices = _cluster.devices_by_id()
    return any(len({devices[int(i)].process_index for i in row}) > 1 for row in table)


def channel_attr(table: np.ndarray, op: str, key: Hashable, data_bytes: int = 0,
                 ll: bool = False) -> dict:
    """The `channel` FFI attribute of one call: the device ids of every group
    (rank order), the workspace channel of (op, group table, `key`) with a
    staging region of at least `data_bytes` (and low-latency lines if `ll`),
    the wait bound, and the testing switch."""
    ch = runtime.channel((op, groups.table_key(table), key), data_bytes, ll=ll)
    return dict(channel=dict(
        group_ids=table.reshape(-1).astype(np.int64), group_size=np.int64(table.shape[1]),
        slot=np.int64(ch.slot), data_offset=np.int64(ch.data_offset),
        data_bytes=np.int64(ch.data_bytes), timeout_ns=np.int64(get_config().timeout_ns),
        skip_post_rank=np.int32(runtime.skip_post_rank())))


def def_eager_impl(prim) -> None:
    """Eager calls of `prim` run its lowering through jax.jit (one compiled
    program per set of parameters)."""
    @functools.cache
    def jitted(**params):
        return jax.jit(functools.partial(prim.bind, **params))
    prim.def_impl(lambda *args, **params: jitted(**params)(*args))
