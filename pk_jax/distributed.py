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


def initialize(**kwargs: Any) -> None:
    """`jax.distributed.initialize`, with the coordinator, process count,
    process id and local devices of `pk_jax.launch` when it started this
    process (explicit keyword arguments win)."""
    if launched():
        kwargs.setdefault("coordinator_address", os.environ[ENV_COORDINATOR])
        kwargs.setdefault("num_processes", int(os.environ[ENV_NUM_PROCESSES]))
        kwargs.setdefault("process_id", int(os.environ[ENV_PROCESS_ID]))
        devices = os.environ.get(ENV_LOCAL_DEVICES)
        if devices:
            kwargs.setdefault("local_device_ids", [int(i) for i in devices.split(",")])
    jax.distributed.initialize(**kwargs)
