"""What every pk_jax kernel lowering shares: the rank table of the axis, the
runtime, the channel attributes, and the fallback when kernels are missing."""

from __future__ import annotations

import numpy as np

from pk_jax import groups, runtime
from pk_jax._warnings import warn_once
from pk_jax.config import get_config


def kernels_missing(op: str, need_gemm: bool = False) -> bool:
    """True (after a one-time warning) when this op cannot run its kernel here."""
    if not runtime.available():
        warn_once(f"{op}-no-extension", f"pk_jax.{op}: native extension unavailable "
                  f"({runtime.extension_error()}); using the XLA reference path")
        return True
    if need_gemm and not runtime.extension().has_gemm:
        warn_once(f"{op}-no-gemm", f"pk_jax.{op}: the extension was built without CUTLASS "
                  "(pip install nvidia-cutlass, then reinstall pk_jax); using the XLA "
                  "reference path")
        return True
    return False


def group_table(ctx, op: str, names: tuple[str, ...], n: int):
    """(extension, [groups, n] device-id table) for the axis being lowered."""
    table = groups.axis_groups(groups.lowering_mesh(ctx, op), names)
    if table.shape[1] != n:
        raise AssertionError(f"mesh group size {table.shape[1]} != axis size {n}")
    ext = runtime.ensure_ready()
    if n > ext.max_ranks:
        raise ValueError(f"pk_jax.{op} supports groups of up to {ext.max_ranks} GPUs, got {n}")
    return ext, table


def channel_attrs(table: np.ndarray, ch: "runtime.Channel") -> dict:
    """FFI attributes every kernel handler takes (xla_ffi/ffi_common.h)."""
    return dict(group_ids=table.reshape(-1), group_size=np.int64(table.shape[1]),
                slot=np.int64(ch.slot), data_offset=np.int64(ch.data_offset),
                timeout_ns=np.int64(get_config().timeout_ns),
                skip_post_rank=np.int32(runtime.skip_post_rank()))
