"""Starting a job of several processes: `pk_jax.distributed.initialize()`.

pk_jax runs wherever `jax.distributed` runs: one process per GPU (the
default under SLURM and Open MPI, where `jax.distributed.initialize()` finds
everything by itself), one process per host driving its GPUs, or anything in
between. Call this instead of `jax.distributed.initialize` to also pick up
the settings of `python -m pk_jax.launch` (which starts one process per GPU
on this host); elsewhere it is exactly `jax.distributed.initialize(**kwargs)`.
pk_jax itself needs nothing more: the processes of a host share their
workspaces at the first pk_jax lowering.

A failing process does not wait for its peers. At exit, JAX's shutdown
waits for every process of the job (a barrier with a timeout of minutes), so
a process that fails while its peers compute, or wait for it in a
collective, would hang with them. After `initialize()`, a process that ends
by an uncaught exception (exit status 1, 130 for KeyboardInterrupt) or by a
`sys.exit` with a failing status (`_fail_fast`) prints what Python prints,
flushes stdout, stderr and logging, and exits at once: `finally` blocks and
context managers have run, atexit functions registered after
`initialize()` run, those registered before it and JAX's shutdown do not.
`python -m pk_jax.launch` then stops the other processes. A clean exit
(status 0) keeps JAX's shutdown, which lets the peers finish.
"""

from __future__ import annotations

import atexit
import dis
import logging
import os
import signal
import sys
import threading
from typing import Any

import jax

# Set by pk_jax.launch for each process it starts.
ENV_COORDINATOR = "PK_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "PK_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PK_JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "PK_JAX_LOCAL_DEVICE_IDS"


def launched() -> bool:
    """Whether this process was started by `python -m pk_jax.launch`."""
    return ENV_COORDINATOR in os.environ


def _env_int(name: str, minimum: int, maximum: int | None = None) -> int:
    """The integer environment variable `name`, in [minimum, maximum]."""
    raw = os.environ.get(name)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"pk_jax.distributed.initialize: {name}={raw!r} must be an integer "
                         "(pk_jax.launch sets it)") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"pk_jax.distributed.initialize: {name}={raw!r} must be {bound}")
    return value


def launch_settings() -> dict[str, Any]:
    """The `jax.distributed.initialize` arguments `pk_jax.launch` set for this
    process (its environment variables, validated), or {} when it did not
    start this process."""
    if not launched():
        return {}
    n = _env_int(ENV_NUM_PROCESSES, 1)
    settings = {"coordinator_address": os.environ[ENV_COORDINATOR], "num_processes": n,
                "process_id": _env_int(ENV_PROCESS_ID, 0, n - 1)}
    devices = os.environ.get(ENV_LOCAL_DEVICES)
    if devices:
        try:
            ids = [int(i) for i in devices.split(",")]
        except ValueError:
            ids = [-1]
        if min(ids) < 0:
            raise ValueError(f"pk_jax.distributed.initialize: {ENV_LOCAL_DEVICES}={devices!r} "
                             "must be a comma-separated list of device ids >= 0")
        settings["local_device_ids"] = ids
    return settings


def initialize(**kwargs: Any) -> None:
    """`jax.distributed.initialize`, with the coordinator, process count,
    process id and local devices of `pk_jax.launch` when it started this
    process (explicit keyword arguments win). Call it once per process,
    before any JAX computation; a second call raises a RuntimeError.

    From then on a failing exit of this process (an uncaught exception, a
    `sys.exit` with a non-zero status) is immediate, without JAX's
    exit-time wait for the other processes (module docstring)."""
    if jax.distributed.is_initialized():
        raise RuntimeError("pk_jax.distributed.initialize: this process already joined its "
                           "job (jax.distributed is initialized); call it once per process, "
                           "before any JAX computation")
    for key, value in launch_settings().items():
        kwargs.setdefault(key, value)
    jax.distributed.initialize(**kwargs)
    _fail_fast()


# ---- a failing exit does not wait for the peers ------------------------------------
# Instructions that end a frame by raising: a handler (finally, an except
# that does not match or re-raises) passing the exception on.
_RAISING = frozenset(dis.opmap[name] for name in ("RERAISE", "RAISE_VARARGS"))
_last_exit: list[SystemExit] = []  # what the main thread's last sys.exit raised
_installed: list[bool] = []


def _exit_now(status: int) -> None:
    """Flush stdout, stderr and logging's handlers and end the process with
    `status`, skipping the rest of Python's shutdown (JAX's included)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or replaced: nothing to flush
            pass
    logging.shutdown()
    os._exit(status)


def _exit_status(code: Any) -> int:
    """The exit status of `SystemExit(code)`, as Python computes it: None
    is 0, an int itself (mod 256), anything else 1 (Python has printed it
    to stderr before the atexit functions run)."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


def _unwound(exc: BaseException) -> bool:
    """Whether `exc` went out of every frame it was raised through, no
    handler keeping it (what ends the interpreter when it was raised in the
    main thread). Its traceback starts at the outermost frame whose handler
    (an except, a finally, a with) saw it, or is None when none did; that
    frame passed it on if it stopped where the exception met it (a with's
    re-raise restores that position) or at a re-raise (a finally, an except
    that raises)."""
    tb = exc.__traceback__
    if tb is None:
        return True
    frame = tb.tb_frame
    lasti = frame.f_lasti
    return lasti == tb.tb_lasti or (lasti >= 0 and frame.f_code.co_code[lasti] in _RAISING)


def _fail_fast() -> None:
    """Make a failing end of this process immediate (module docstring):
    sys.excepthook ends the process after printing an uncaught exception
    (when Python calls it for one, not when code reports an exception with it);
    sys.exit records the SystemExit it raises in the main thread, and an
    atexit function (run before JAX's, registered after them) ends the
    process when that SystemExit, with a failing status, ended the
    interpreter. A SystemExit raised otherwise (`raise SystemExit(1)`,
    `exit(1)`) gets Python's normal shutdown, JAX's wait included."""
    if _installed:
        return
    _installed.append(True)
    hook, exit_ = sys.excepthook, sys.exit

    def excepthook(kind, value, tb):
        hook(kind, value, tb)
        if sys._getframe().f_back is None:  # Python's own call: the exception ends it
            _exit_now(128 + signal.SIGINT if issubclass(kind, KeyboardInterrupt) else 1)

    def exit(status=None):  # noqa: A001 - sys.exit's name
        exc = SystemExit(status)
        if threading.current_thread() is threading.main_thread():
            _last_exit[:] = [exc]
        raise exc

    def at_exit():
        if _last_exit and _unwound(_last_exit[0]):
            status = _exit_status(_last_exit[0].code)
            if status:
                _exit_now(status)

    exit.__doc__ = exit_.__doc__
    sys.excepthook, sys.exit = excepthook, exit
    atexit.register(at_exit)
