"""Where the devices of a job live: this process, the other processes of its
host, other hosts; and the job-wide key-value store of `jax.distributed`
through which the processes agree on what must be identical everywhere
(workspace handles, channels).

One process driving every GPU (no `jax.distributed`) needs none of it: every
function here then answers for one process on one host without a store.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import uuid
from typing import Any

import jax

# How long a process waits for the others to publish what it needs (they
# lower the same program at about the same time).
EXCHANGE_TIMEOUT_S = 300
_PREFIX = "pk_jax"
_lock = threading.Lock()


def client() -> Any | None:
    """jax.distributed's client, or None when this is a single-process job."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover
        return None
    return getattr(distributed.global_state, "client", None)


def process_count() -> int:
    return jax.process_count()


def multiprocess() -> bool:
    """Several processes with a key-value store to agree through."""
    return client() is not None and process_count() > 1


def process_index() -> int:
    return jax.process_index()


def _local_host_id() -> str:
    """This host's identity: PK_JAX_HOST_ID (tests simulate several hosts
    with it), else the host name and the kernel's boot id."""
    forced = os.environ.get("PK_JAX_HOST_ID")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@functools.lru_cache(maxsize=None)
def nonce() -> str:
    """An id of this job's pk_jax state, the same on every process: the
    prefix of every key pk_jax puts in the store (and of any name it gives a
    shared resource), so two pk_jax runtimes never read each other's keys."""
    kv = client()
    if kv is None:
        return uuid.uuid4().hex
    key = f"{_PREFIX}/nonce"
    if process_index() == 0:
        kv.key_value_set(key, uuid.uuid4().hex)
    return kv.blocking_key_value_get(key, EXCHANGE_TIMEOUT_S * 1000)


def key(*parts: object) -> str:
    return "/".join([_PREFIX, nonce(), *map(str, parts)])


def publish(name: str, value: dict) -> None:
    """Put this process's `value` (JSON) under `name` (unique per process)."""
    client().key_value_set(key(name), json.dumps(value))


def fetch(name: str, what: str) -> dict:
    """The value another process published under `name` (waits, bounded)."""
    try:
        raw = client().blocking_key_value_get(key(name), EXCHANGE_TIMEOUT_S * 1000)
    except Exception as e:  # the store's timeout error type varies between versions
        raise RuntimeError(
            f"pk_jax: no answer within {EXCHANGE_TIMEOUT_S} s for {what} (key {name!r}): every "
            "process of the job must compile the same pk_jax programs; is one of them stuck "
            f"or running another program? ({type(e).__name__}: {e})") from None
    return json.loads(raw)


@functools.lru_cache(maxsize=None)
def hosts() -> tuple[str, ...]:
    """Host identity of every process, by process index (exchanged once)."""
    if not multiprocess():
        return (_local_host_id(),) * process_count()
    with _lock:
        publish(f"host/{process_index()}", {"host": _local_host_id()})
        return tuple(fetch(f"host/{p}", f"the host of process {p}")["host"]
                     for p in range(process_count()))


def host_of(device: jax.Device) -> str:
    return hosts()[device.process_index]


def is_local(device: jax.Device) -> bool:
    return device.process_index == process_index()


def devices_by_id() -> dict[int, jax.Device]:
    return {d.id: d for d in jax.devices()}
