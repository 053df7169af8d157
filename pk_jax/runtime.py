"""Native runtime: loads the extension, registers FFI targets, owns the
symmetric workspaces, the channel table and kernel-reported errors.

Nothing here touches a GPU at import. The extension is loaded the first time
a pk_jax op is lowered for a CUDA device; on machines with no GPU (or no
built extension) every op lowers to its reference path instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from typing import Any, Hashable, Iterator

import jax

from pk_jax import config
from pk_jax.errors import PkJaxError, PkJaxTimeoutError

# Limits of the native layout (csrc/pk/layout.h; tests/test_constants_cpu.py
# checks every mirrored constant against the headers).
MAX_RANKS = 16          # kMaxRanks: largest group a kernel handles
MAX_SLOTS = 256         # kMaxSlots: channels of the workspace
LL_CHANNELS = 32        # kLlChannels: the first channels carry low-latency lines
LL_MAX_BYTES = 16 << 10  # kLlMaxBytes: largest low-latency message per rank

_lock = threading.RLock()
_ext: Any = None
_ext_error: str | None = None
_registered = False
_channels: dict[Hashable, "Channel"] = {}
_data_used = 0  # bytes of the workspace data area handed to channels
_DATA_ALIGN = 4096
_skip_post_rank = -1  # testing switch, see testing_skip_post()


def extension() -> Any | None:
    """The native module, or None when it is not built or cannot load."""
    global _ext, _ext_error
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                _ext = importlib.import_module("pk_jax._pk_jax_ext")
            except ImportError as e:
                _ext_error = str(e)
        return _ext


def extension_error() -> str | None:
    """Why the extension did not load (None if it did or was not tried)."""
    extension()
    return _ext_error


def gpu_devices() -> list[jax.Device]:
    """Local CUDA devices that JAX drives (empty on CPU-only machines)."""
    try:
        return [d for d in jax.local_devices(backend="gpu") if d.platform == "gpu"]
    except RuntimeError:
        return []


def available() -> bool:
    """True when fused kernels can run: extension built and CUDA GPUs present."""
    return extension() is not None and bool(gpu_devices())


def initialized() -> bool:
    """True once the workspaces are allocated."""
    ext = _ext
    return ext is not None and bool(ext.initialized())


def ensure_ready() -> Any:
    """Register the FFI targets and allocate the workspaces (once).

    Called from lowering rules, i.e. before any pk_jax kernel can run, so the
    allocation never happens while a peer kernel is spinning.
    """
    global _registered
    ext = extension()
    if ext is None:
        raise PkJaxError(f"pk_jax native extension unavailable: {_ext_error}")
    with _lock:
        if not _registered:
            for name, capsule in ext.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered = True
        if not ext.initialized():
            devices = [(d.id, d.local_hardware_id) for d in gpu_devices()]
            ext.init_runtime(devices, config.get_config().workspace_bytes)
            config.workspace_allocated()
    return ext


def workspace_data_bytes() -> int:
    """Bytes of the workspace data area (allocated, or as configured)."""
    ext = _ext
    if ext is not None and ext.initialized():
        return int(ext.data_bytes())
    return config.get_config().workspace_bytes


@dataclasses.dataclass(frozen=True)
class Channel:
    """A workspace channel: flags (slot) and, for staged mechanisms, a data
    region of its own, at the same offsets on every GPU."""

    slot: int
    data_offset: int = 0
    data_bytes: int = 0


def channel(key: Hashable, data_bytes: int = 0, ll: bool = False) -> Channel:
    """The channel of one (op, device group, configuration).

    Every distinct key gets its own flags and epoch counter on each device,
    and its own data region of `data_bytes`, so staged transfers of
    different ops or groups never overwrite each other. All ranks of a group
    lower the same program and compute the same key, so they agree on the
    channel. Channels that carry low-latency lines (`ll`) take the first
    LL_CHANNELS slots, the others the rest.
    """
    global _data_used
    with _lock:
        full_key = (key, int(data_bytes), bool(ll))
        found = _channels.get(full_key)
        if found is not None:
            return found
        first, end = (0, LL_CHANNELS) if ll else (LL_CHANNELS, MAX_SLOTS)
        used = sum(1 for (_, _, k_ll) in _channels if k_ll == ll)
        if first + used >= end:
            kind = "low-latency (small all_gather)" if ll else "other"
            raise PkJaxError(
                f"pk_jax: the program needs more than {end - first} distinct {kind} channels "
                "((op, device group, size) combinations); this build supports at most that "
                "many" + ("; use all_gather(mechanism='ld_st_push') for some calls" if ll else ""))
        offset = _data_used
        region_end = offset + -(-int(data_bytes) // _DATA_ALIGN) * _DATA_ALIGN
        if region_end > workspace_data_bytes():
            raise PkJaxError(
                f"pk_jax: the workspace data area is too small: this op needs {data_bytes} "
                f"bytes, {workspace_data_bytes() - offset} of {workspace_data_bytes()} are "
                "left; raise pk_jax.configure(workspace_bytes=...) or PK_JAX_WORKSPACE_BYTES "
                "(before the first op), or pick a mechanism that stages nothing")
        _data_used = region_end
        found = _channels[full_key] = Channel(first + used, offset, int(data_bytes))
        return found


def check_errors() -> None:
    """Raise PkJaxTimeoutError if a kernel reported a failed wait.

    Kernels never hang: a wait that exceeds the timeout records which rank
    waited for which peer and lets the kernel finish. This waits for the GPUs,
    clears that state (flags and error records) so the process can go on,
    and raises with every recorded message.
    """
    ext = _ext
    if ext is None or not ext.initialized():
        return
    messages = list(ext.pending_errors())
    if messages:
        ext.reset()
        raise PkJaxTimeoutError("\n".join(messages))


def skip_post_rank() -> int:
    return _skip_post_rank


@contextlib.contextmanager
def testing_skip_post(rank: int) -> Iterator[None]:
    """Testing only: ops lowered inside make `rank` never post its signal,
    so its peers' bounded waits must time out."""
    global _skip_post_rank
    saved, _skip_post_rank = _skip_post_rank, int(rank)
    try:
        yield
    finally:
        _skip_post_rank = saved
