"""Native runtime: loads the extension, registers FFI targets, owns the
symmetric workspaces, the channel table and kernel-reported errors.

Nothing here touches a GPU at import. The extension is loaded the first time
a pk_jax op is lowered for a CUDA device; on machines with no GPU (or no
built extension) every op lowers to its reference path instead.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Hashable, Iterator

import jax

from pk_jax.config import get_config
from pk_jax.errors import PkJaxError, PkJaxTimeoutError

_lock = threading.RLock()
_ext: Any = None
_ext_error: str | None = None
_registered = False
_slots: dict[Hashable, int] = {}
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
            ext.init_runtime(devices, get_config().workspace_bytes)
    return ext


def workspace_data_bytes() -> int:
    """Bytes of the workspace data area (allocated, or as configured)."""
    ext = _ext
    if ext is not None and ext.initialized():
        return int(ext.data_bytes())
    return get_config().workspace_bytes


def channel_slot(key: Hashable) -> int:
    """Workspace channel of one (op, device group) pair.

    Every distinct key gets its own flags and epoch counter on each device.
    All ranks of a group compute the same key, so they agree on the slot.
    """
    with _lock:
        slot = _slots.get(key)
        if slot is None:
            ext = extension()
            limit = ext.max_slots if ext is not None else 256
            if len(_slots) >= limit:
                raise PkJaxError(
                    f"pk_jax: more than {limit} distinct (op, device group) channels; "
                    "this build supports at most that many")
            slot = _slots[key] = len(_slots)
        return slot


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
