"""Helpers shared by the GPU tests."""

import dataclasses
import pathlib
import re
import tempfile

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
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*custom_call_target="([^"]+)"', re.M)
_THUNK = re.compile(r"^( *)(\d+): (k\w+)")
_META = re.compile(r'thunk_metadata \{\s*thunk_info \{(.*?)\}\s*thunk_kind: "(\w+)"', re.S)


def command_buffer_targets(hlo_text: str) -> set[str]:
    """The custom-call targets XLA captured in a command buffer (CUDA graph)
    of a compiled module, where XLA forms them as HLO computations: those
    inside its `command_buffer` computations (what the HLO pass of
    command-buffer scheduling outlines and calls), read from
    `compiled.as_text()`. A custom call left outside every command buffer
    runs its handler on every call, and is not in the set. XLA versions that
    form command buffers from the thunk sequence instead (jax 0.11's) show
    none here: `captured` reads both."""
    return outlined_command_buffers(hlo_text)[1]


def outlined_command_buffers(hlo_text: str) -> tuple[int, set[str]]:
    """The `command_buffer` computations of a compiled module's text: how
    many, and the custom-call targets inside them (`command_buffer_targets`)."""
    count, targets, inside = 0, set(), False
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            inside = start.group(1).split(".")[0] == "command_buffer"
            count += inside
        elif line.startswith("}"):
            inside = False
        elif inside:
            targets.update(_TARGET.findall(line))
    return count, targets


def thunk_command_buffers(sequence: str) -> tuple[int, set[int]]:
    """A dumped thunk sequence (`<module>.thunk_sequence_after_thunk_passes.txt`,
    one thunk a line, `NNN: kKind ...`, a thunk's commands indented below it):
    the number of kCommandBuffer thunks and the ids of the thunks inside one."""
    count, inside, stack = 0, set(), []  # stack: (indent, kind) of the enclosing thunks
    for line in sequence.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if any(k == "kCommandBuffer" for _, k in stack):
            inside.add(thunk_id)
        count += kind == "kCommandBuffer"
        stack.append((indent, kind))
    return count, inside


def thunk_annotations(metadata: str) -> dict[int, str]:
    """A dumped `<module>.thunk_metadata.txt`: {thunk id: its profile
    annotation, the HLO instruction it runs} for the custom-call thunks."""
    out = {}
    for info, kind in _META.findall(metadata):
        tid = re.search(r"thunk_id: (\d+)", info)
        name = re.search(r'profile_annotation: "([^"]+)"', info)
        if kind == "kCustomCall" and tid and name:
            out[int(tid.group(1))] = name.group(1)
    return out


@dataclasses.dataclass(frozen=True)
class CommandBuffers:
    """What XLA put into command buffers when it compiled one module."""

    targets: frozenset  # the custom-call targets captured in one
    count: int          # command buffers: outlined computations or kCommandBuffer thunks
    text: str           # the compiled module's text


def dumped_command_buffers(dump_dir, hlo_text: str) -> tuple[int, set[str]]:
    """The kCommandBuffer thunks of the modules XLA dumped to `dump_dir`
    (--xla_dump_to with --xla_dump_hlo_as_text) and the custom-call targets
    inside them: thunk ids -> instructions (the thunk metadata) -> targets
    (the instructions' custom_call_target in `hlo_text`)."""
    names = dict(_INSTRUCTION.findall(hlo_text))
    count, targets = 0, set()
    suffix = ".thunk_sequence_after_thunk_passes.txt"
    for seq in pathlib.Path(dump_dir).glob("*" + suffix):
        meta = pathlib.Path(str(seq)[: -len(suffix)] + ".thunk_metadata.txt")
        n, inside = thunk_command_buffers(seq.read_text())
        annotations = thunk_annotations(meta.read_text()) if meta.exists() else {}
        count += n
        targets |= {names[a] for i in inside if (a := annotations.get(i)) in names}
    return count, targets


def captured(lowered) -> CommandBuffers:
    """Compile `lowered` (a jax `Lowered`, under this process's XLA flags) and
    read which custom calls XLA put into command buffers, however this XLA
    forms them: outlined `command_buffer` computations in the module's text
    (`outlined_command_buffers`), or kCommandBuffer thunks in the thunk
    sequence it dumps (`dumped_command_buffers`; the compile dumps to a
    temporary folder through its compiler options)."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        text = compiled.as_text()
        count, targets = dumped_command_buffers(dump, text)
    hlo_count, hlo_targets = outlined_command_buffers(text)
    return CommandBuffers(frozenset(targets | hlo_targets), count + hlo_count, text)
