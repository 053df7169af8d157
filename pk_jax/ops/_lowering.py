"""What every pk_jax kernel lowering shares: the fallback when kernels are
missing, the rank table of the axis, and the channel attribute that every
collective handler takes (xla_ffi/ffi_common.h: ChannelAttrs)."""

from __future__ import annotations

from typing import Hashable

import numpy as np

from pk_jax import groups, runtime
from pk_jax._warnings import warn_once
from pk_jax.config import get_config


def kernels_missing(op: str, need_cutlass: bool = False) -> bool:
    """True (after a one-time warning) when this op cannot run its kernel here."""
    if not runtime.available():
        warn_once(f"{op}-no-extension", f"pk_jax.{op}: native extension unavailable "
                  f"({runtime.extension_error()}); using the XLA reference path")
        return True
    if need_cutlass and not runtime.extension().has_gemm:
        warn_once(f"{op}-no-gemm", f"pk_jax.{op}: the extension was built without CUTLASS "
                  "(pip install nvidia-cutlass, then reinstall pk_jax); using the XLA "
                  "reference path")
        return True
    return False


def channel_attr(ctx, op: str, names: tuple[str, ...], n: int, key: Hashable,
                 data_bytes: int = 0, ll: bool = False) -> dict:
    """The `channel` FFI attribute of one call: the device ids of every group
    of the axis (rank order), the workspace channel of (op, group table,
    `key`) with a data region of `data_bytes` (and low-latency lines if
    `ll`), the wait bound, and the testing switch."""
    table = groups.axis_groups(groups.lowering_mesh(ctx, op), names)
    if table.shape[1] != n:
        raise AssertionError(f"mesh group size {table.shape[1]} != axis size {n}")
    if n > runtime.MAX_RANKS:
        raise ValueError(f"pk_jax.{op} supports groups of up to {runtime.MAX_RANKS} GPUs, "
                         f"got {n}")
    runtime.ensure_ready()
    ch = runtime.channel((op, table.tobytes(), key), data_bytes, ll=ll)
    return dict(channel=dict(
        group_ids=table.reshape(-1), group_size=np.int64(n), slot=np.int64(ch.slot),
        data_offset=np.int64(ch.data_offset), data_bytes=np.int64(ch.data_bytes),
        timeout_ns=np.int64(get_config().timeout_ns),
        skip_post_rank=np.int32(runtime.skip_post_rank())))
