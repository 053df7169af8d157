"""Starting a job of several processes: `pk_jax.distributed.initialize()`.

pk_jax runs wherever `jax.distributed` runs: one process per GPU (the
default under SLURM and Open MPI, where `jax.distributed.initialize()` finds
everything by itself), one process per host driving its GPUs, or anything in
between. Call this instead of `jax.distributed.initialize` to also pick up
the settings of `python -m pk_jax.launch` (which starts one process per GPU
on this host); elsewhere it is exactly `jax.distributed.initialize(**kwargs)`.
pk_jax itself needs nothing more: the processes of a host share their
workspaces at the first pk_jax lowering.
"""

from __future__ import annotations

import os
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
    before any JAX computation; a second call raises a RuntimeError."""
    if jax.distributed.is_initialized():
        raise RuntimeError("pk_jax.distributed.initialize: this process already joined its "
                           "job (jax.distributed is initialized); call it once per process, "
                           "before any JAX computation")
    for key, value in launch_settings().items():
        kwargs.setdefault(key, value)
    jax.distributed.initialize(**kwargs)
