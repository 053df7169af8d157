"""Helpers shared by the GPU tests."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def random_bits(rng, shape, dtype) -> np.ndarray:
    """Random bit patterns of `dtype` (every byte random, NaNs included):
    compared as raw bits, so any misplaced or unwritten byte shows."""
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return raw.view(_UINT[itemsize]).reshape(shape)


def as_bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(_UINT[a.dtype.itemsize])


def poison_allocator(mesh, nbytes: int) -> None:
    """Fill about `nbytes` per device with 0xFF and free it, so that the next
    outputs the allocator hands out start as poison rather than as an
    earlier (possibly correct) result."""
    n = max(nbytes // 4, 1)
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    size = mesh.devices.size
    p = jax.jit(lambda: jnp.full((size * n,), 0xFFFFFFFF, jnp.uint32), out_shardings=sharding)()
    p.block_until_ready()
    del p


def put(mesh, host: np.ndarray, dtype):
    """Place a host array of raw bits sharded on the mesh's first axis."""
    x = jax.device_put(host, NamedSharding(mesh, P(mesh.axis_names[0])))
    return jax.lax.bitcast_convert_type(x, dtype) if np.dtype(dtype) != host.dtype else x


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def command_buffer_targets(hlo_text: str) -> set[str]:
    """The custom-call targets XLA captured in a command buffer (CUDA graph)
    of a compiled module: those inside its `command_buffer` computations
    (what XLA's command-buffer scheduling outlines and calls), read from
    `compiled.as_text()`. A custom call left outside every command buffer
    runs its handler on every call, and is not in the set."""
    targets, inside = set(), False
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            inside = start.group(1).split(".")[0] == "command_buffer"
        elif line.startswith("}"):
            inside = False
        elif inside:
            targets.update(_TARGET.findall(line))
    return targets
