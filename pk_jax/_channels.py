"""The workspace's channels and staging regions, assigned at lowering.

A channel is a slot of flags (epochs, posts, credits) that every call of one
(op, device group, configuration) uses in turn on each device; its calls
are ordered by the channel's epochs, so they may share a staging region: a
call writes a peer's region only after that peer finished reading the
previous call's data (the credit wait). A channel's regions come in
power-of-two size classes, so a process that runs many shapes (sweeps,
evaluation) needs at most about twice its largest staging size per channel,
not the sum of all shapes.

Slots and region offsets are baked into the compiled programs, so the ranks
of a group must agree on them. One process: a local table. Several
processes (`jax.distributed`): the job's key-value store decides, whichever
process lowers a channel first; every process then compiles the same
program whatever the order in which it lowers its programs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from typing import Hashable

from pk_jax import _cluster
from pk_jax.errors import PkJaxError

MAX_SLOTS = 256          # kMaxSlots (csrc/pk/layout.h)
LL_CHANNELS = 32         # kLlChannels: the first channels carry low-latency lines
REGION_ALIGN = 64 << 10  # smallest size class of a staging region

_lock = threading.Lock()
_slots: dict[str, int] = {}            # channel digest -> slot
_regions: dict[tuple[str, int], int] = {}  # (channel digest, size class) -> offset
_used = {"ll": 0, "other": 0, "data": 0}  # local allocation (single process)


@dataclasses.dataclass(frozen=True)
class Channel:
    """A workspace channel: its flags (slot) and its staging region (offset
    and size in the data area; 0 and 0 for mechanisms that stage nothing)."""

    slot: int
    data_offset: int = 0
    data_bytes: int = 0


def digest(key: Hashable) -> str:
    """A short stable name of `key` (the same in every process)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def size_class(nbytes: int) -> int:
    """The region size that holds `nbytes`: a power of two, at least REGION_ALIGN."""
    size = REGION_ALIGN
    while size < nbytes:
        size *= 2
    return size


def _claim(name: str, counter: str, amount: int) -> int:
    """The value agreed for `name`: the first process to get here takes the
    next `amount` of `counter` (an atomic counter of the store) and records
    it; every process (that one too) returns the recorded value."""
    kv = _cluster.client()
    try:
        found = kv.key_value_try_get(_cluster.key(name))
    except Exception:  # not recorded yet
        found = None
    if found is None:
        taken = kv.key_value_increment(_cluster.key(counter), amount) - amount
        try:
            kv.key_value_set(_cluster.key(name), json.dumps({"value": taken}))
        except Exception:  # another process recorded it first: its value holds
            pass
        found = kv.blocking_key_value_get(_cluster.key(name), _cluster.EXCHANGE_TIMEOUT_S * 1000)
    return int(json.loads(found)["value"])


def _slot(name: str, ll: bool) -> int:
    first, end = (0, LL_CHANNELS) if ll else (LL_CHANNELS, MAX_SLOTS)
    kind = "ll" if ll else "other"
    if _cluster.multiprocess():
        slot = first + _claim(f"slot/{name}", f"slots/{kind}", 1)
    else:
        slot = first + _used[kind]
        _used[kind] += 1
    if slot >= end:
        what = "low-latency (small all_gather)" if ll else "pk_jax"
        raise PkJaxError(
            f"pk_jax: the programs of this process need more than {end - first} {what} channels "
            "(distinct (op, device group, configuration) combinations); this build supports "
            "at most that many" + ("; use all_gather(mechanism='ld_st_push') for some "
                                   "calls" if ll else ""))
    return slot


def _region(name: str, size: int, capacity: int) -> int:
    if _cluster.multiprocess():
        offset = _claim(f"region/{name}/{size}", "data", size)
    else:
        offset = _used["data"]
        _used["data"] += size
    if offset + size > capacity:
        raise PkJaxError(
            f"pk_jax: the workspace data area is too small: this op stages {size} bytes "
            f"(a region of its size class), {max(capacity - offset, 0)} of {capacity} are "
            "left; raise pk_jax.configure(workspace_bytes=...) or PK_JAX_WORKSPACE_BYTES "
            "(before the first op), or pick a mechanism that stages nothing")
    return offset


def channel(key: Hashable, data_bytes: int = 0, ll: bool = False,
            capacity: int = 0) -> Channel:
    """The channel of `key` (op, device group, configuration; the same on
    every rank of the group) and, for `data_bytes` > 0, a region of at least
    that many bytes in a data area of `capacity` bytes."""
    name = digest((key, bool(ll)))
    with _lock:
        slot = _slots.get(name)
        if slot is None:
            slot = _slots[name] = _slot(name, ll)
        if data_bytes <= 0:
            return Channel(slot)
        size = size_class(int(data_bytes))
        offset = _regions.get((name, size))
        if offset is None:
            offset = _regions[(name, size)] = _region(name, size, capacity)
        return Channel(slot, offset, size)
