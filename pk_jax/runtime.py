"""Native runtime: loads the extension, registers FFI targets, allocates the
symmetric workspaces and shares them with the other processes of the host,
decides whether a device group can run the kernels, and reports the errors
kernels recorded.

Nothing here touches a GPU at import. The extension is loaded the first time
a pk_jax op is lowered for a CUDA device; on machines with no GPU (or no
built extension, or GPUs the kernels were not built for) every op lowers to
its reference path instead.

Processes: one process may drive all GPUs of a host, or each GPU may have its
own process (jax.distributed, the default under SLURM / MPI), or anything in
between. At the first lowering every process allocates its workspaces and
publishes their CUDA IPC handles in jax.distributed's key-value store; every
process maps the workspaces of the other processes of its host. A group
(the devices of one mesh axis) runs the kernels when all its GPUs are on one
host and reach each other (NVLink or PCIe peer access); otherwise the ops
take XLA's collectives (pk_jax/ops/_lowering.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import itertools
import os
import threading
from typing import Any, Hashable, Iterator

import jax
import numpy as np

from pk_jax import _channels, _cluster, config, groups
from pk_jax._channels import LL_CHANNELS, MAX_SLOTS, Channel  # noqa: F401 (re-exported)
from pk_jax.errors import PkJaxError, PkJaxTimeoutError

# Limits of the native layout (csrc/pk/layout.h; tests/test_constants_cpu.py
# checks every mirrored constant against the headers).
MAX_RANKS = 16          # kMaxRanks: largest group a kernel handles
LL_MAX_BYTES = 16 << 10  # kLlMaxBytes: largest low-latency message per rank
# Bound of the host's waits for the GPUs (check_errors, reset).
SYNC_TIMEOUT_S = 60.0

_lock = threading.RLock()
_ext: Any = None
_ext_error: str | None = None
_init_error: str | None = None
_registered = False
_peers: dict[int, dict] = {}       # global id -> what its process published (same host)
_connected: set[tuple] = set()     # group tables whose peer access is set up
_verdicts: dict[tuple, str | None] = {}  # group table -> why the kernels cannot run
_checks = itertools.count()        # check_errors calls (multi-process: one barrier each)
_skip_post_rank = -1  # testing switch, see testing_skip_post()


def extension() -> Any | None:
    """The native module, or None when it is not built or cannot load."""
    global _ext, _ext_error
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                _ext = importlib.import_module("pk_jax._pk_jax_ext")
            except ImportError as e:
                _ext_error = _why_no_extension(e)
        return _ext


def _why_no_extension(error: ImportError) -> str:
    """The install's own record of why it has no kernels, else the error."""
    try:
        from pk_jax import _build_info  # written by the build (build_backend/)
    except ImportError:
        return str(error)
    if not _build_info.cuda:
        return (f"this install has no CUDA kernels ({_build_info.reason}); reinstall with "
                "PK_JAX_BUILD_CUDA=1 on a machine with nvcc to build them")
    return str(error)


def extension_error() -> str | None:
    """Why the kernels cannot run here (None when they can or nobody tried)."""
    extension()
    return _ext_error or _init_error


def gpu_devices() -> list[jax.Device]:
    """Local CUDA devices that JAX drives (empty on CPU-only machines)."""
    try:
        return [d for d in jax.local_devices(backend="gpu") if d.platform == "gpu"]
    except RuntimeError:
        return []


def available() -> bool:
    """True when the kernels can run here: the extension is built, this
    process drives CUDA GPUs, and setting up the workspaces did not fail."""
    return extension() is not None and bool(gpu_devices()) and _init_error is None


def initialized() -> bool:
    """True once the workspaces are allocated."""
    ext = _ext
    return ext is not None and bool(ext.initialized())


def ensure_ready() -> Any:
    """Register the FFI targets, allocate the workspaces and share them with
    the other processes of this host (once).

    Called from lowering rules, before any pk_jax kernel can run, so no
    allocation happens while a peer kernel spins. A failure is remembered
    (no retry at every lowering): `available()` is False afterwards and the
    ops take their reference path.
    """
    global _registered, _init_error
    ext = extension()
    if ext is None:
        raise PkJaxError(f"pk_jax native extension unavailable: {_ext_error}")
    with _lock:
        if _init_error is not None:
            raise PkJaxError(_init_error)
        if not _registered:
            for name, capsule in ext.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered = True
        if not ext.initialized():
            try:
                _init(ext)
            except Exception as e:  # the native side cleaned up; remember why
                _init_error = f"pk_jax: setting up the GPU workspaces failed: {e}"
                raise PkJaxError(_init_error) from e
    return ext


def _preload_cublaslt() -> None:
    """Loads the nvidia-cublas package's cuBLASLt, where one is installed
    and no copy is loaded yet, so the extension's init finds it by name
    (csrc/kernels/gemm/cublaslt.h; XLA's GPU plugin usually loaded it
    already). Nothing happens where there is none: the FP8 GEMMs then run
    the CUTLASS kernels."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for lib in ("cu13/lib/libcublasLt.so.13", "cublas/lib/libcublasLt.so.12"):
            path = os.path.join(root, lib)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path)
                except OSError:
                    continue
                return


def _init(ext) -> None:
    _preload_cublaslt()
    local = gpu_devices()
    several = _cluster.multiprocess()
    for d in local:
        info = ext.device_info(d.local_hardware_id)
        if not info["supported"]:
            raise PkJaxError(f"the kernels are built for Hopper (sm_90) GPUs, not {d} "
                             f"(compute capability {info['compute_capability']})")
        if several and not info.get("ipc", True):
            raise PkJaxError(f"{d} cannot share memory with other processes (CUDA IPC)")
    ext.init_runtime([(d.id, d.local_hardware_id) for d in local],
                     config.get_config().workspace_bytes)
    config.workspace_allocated()
    if several:
        _share_workspaces(ext, local)


def _share_workspaces(ext, local: list[jax.Device]) -> None:
    """Publish this process's workspaces; map those of the other processes
    of this host (they publish theirs at their first lowering too)."""
    me = _cluster.process_index()
    _cluster.publish(f"workspaces/{me}", {"devices": [
        dict(id=d.id, pci=ext.device_info(d.local_hardware_id)["pci_bus_id"],
             handle=bytes(ext.export_workspace(d.local_hardware_id)).hex(),
             data_bytes=int(ext.data_bytes()))
        for d in local]})
    hosts = _cluster.hosts()
    for p in range(_cluster.process_count()):
        if p == me or hosts[p] != hosts[me]:
            continue
        for dev in _cluster.fetch(f"workspaces/{p}", f"the workspaces of process {p}")["devices"]:
            ext.import_peer(int(dev["id"]), bytes.fromhex(dev["handle"]), dev["pci"],
                            int(dev["data_bytes"]))
            _peers[int(dev["id"])] = dev


def group_problem(table: np.ndarray) -> str | None:
    """Why the kernels cannot run on the groups of `table` ([groups, n]
    device ids), or None when they can: every group's GPUs on one host,
    known to this process, each GPU of this process reaching the others of
    its group. Several processes decide together (each checks the groups it
    is in), so every process lowers the same program."""
    with _lock:
        key = groups.table_key(table)
        if key not in _verdicts:
            verdict = _local_problem(table)
            if _cluster.multiprocess():
                name = f"group/{_channels.digest(key)}"
                me = _cluster.process_index()
                _cluster.publish(f"{name}/{me}", {"problem": verdict})
                verdicts = [_cluster.fetch(f"{name}/{p}", "a device group's check")["problem"]
                            for p in range(_cluster.process_count())]
                verdict = next((v for v in verdicts if v), None)
            _verdicts[key] = verdict
        return _verdicts[key]


def _local_problem(table: np.ndarray) -> str | None:
    devices = _cluster.devices_by_id()
    here = _cluster.hosts()[_cluster.process_index()]
    ext = extension()
    for row in table:
        members = [devices[int(i)] for i in row]
        hosts = {_cluster.host_of(d) for d in members}
        if len(hosts) > 1:
            return (f"its group {[int(i) for i in row]} spans {len(hosts)} hosts (pk_jax groups "
                    "must stay inside one host: put this mesh axis within a node and the "
                    "cross-node axes on XLA's collectives)")
        local = [d for d in members if _cluster.is_local(d)]
        if hosts != {here} or not local:
            continue  # the processes of that group decide for it
        pci = {d.id: ext.device_info(d.local_hardware_id)["pci_bus_id"] for d in local}
        for d in members:
            if not _cluster.is_local(d):
                if int(d.id) not in _peers:
                    return f"device {d.id} of its group shared no workspace with this process"
                pci[d.id] = _peers[int(d.id)]["pci"]
        for a in local:
            for b in members:
                if b.id != a.id and not ext.can_access(a.local_hardware_id, pci[b.id]):
                    return f"device {a.id} has no peer access to device {b.id}"
    return None


def connect(table: np.ndarray) -> None:
    """Enable peer access inside every group of `table` that holds a device
    of this process (only between GPUs that share a group)."""
    key = groups.table_key(table)
    if key in _connected:
        return
    local = {d.id for d in gpu_devices()}
    ext = ensure_ready()
    for row in table:
        if local & {int(i) for i in row}:
            ext.connect_group([int(i) for i in row])
    _connected.add(key)


def workspace_data_bytes() -> int:
    """Bytes of the workspace data area (allocated, or as configured)."""
    ext = _ext
    if ext is not None and ext.initialized():
        return int(ext.data_bytes())
    return config.get_config().workspace_bytes


def channel(key: Hashable, data_bytes: int = 0, ll: bool = False) -> Channel:
    """The channel (and staging region) of one (op, device group,
    configuration): pk_jax/_channels.py."""
    return _channels.channel(key, data_bytes, ll, workspace_data_bytes())


def check_errors() -> None:
    """Raise PkJaxTimeoutError if a kernel recorded a failed wait.

    Kernels never hang: a wait that exceeds the timeout records which rank
    waited for which peer and lets the kernel finish (its outputs are
    NaN-poisoned). This waits (bounded) for this process's GPUs, so a failure
    still in flight is seen, clears the state (flags and error records) so
    the process can go on, and raises with every recorded message. In a job
    of several processes it is collective: every process calls it at the
    same point; if any of them recorded a failure, all reset together
    (barriers before and after, so no stale flag of a peer satisfies a
    fresh wait) and all raise.
    """
    ext = _ext
    if ext is None or not ext.initialized():
        return
    ext.synchronize(SYNC_TIMEOUT_S)
    messages = list(ext.pending_errors())
    failed_elsewhere: list[int] = []
    multi = _cluster.multiprocess()
    if multi:
        k, me = next(_checks), _cluster.process_index()
        _cluster.publish(f"check/{k}/{me}", {"errors": len(messages)})
        failed_elsewhere = [p for p in range(_cluster.process_count()) if p != me and
                            _cluster.fetch(f"check/{k}/{p}", "check_errors")["errors"]]
    if not messages and not failed_elsewhere:
        return
    if multi:
        _barrier(f"reset/{k}/before")
    ext.reset(SYNC_TIMEOUT_S)
    if multi:
        _barrier(f"reset/{k}/after")
    if failed_elsewhere and not messages:
        messages = [f"pk_jax: process(es) {failed_elsewhere} recorded failed waits (their "
                    "check_errors() raised with the details); the outputs of the calls since "
                    "the failure are poisoned (NaN; integer gathers: all bits set)"]
    raise PkJaxTimeoutError("\n".join(messages))


def _barrier(name: str) -> None:
    _cluster.client().wait_at_barrier(_cluster.key(name), _cluster.EXCHANGE_TIMEOUT_S * 1000)


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
