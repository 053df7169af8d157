"""The `channel` attribute that pk_jax's lowerings build (ops/_lowering.py)
decodes in C++ into the struct every collective handler binds
(xla_ffi/ffi_common.h: ChannelAttrs): a CPU handler compiled from
tests/native/channel_attrs_check.cc reads every member back; a member of the
wrong type or a missing one is refused."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _channels, groups
from pk_jax.ops import _lowering
from conftest import cpu_mesh, cuda_home

ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _target() -> str:
    """Build the check handler once and register it for CPU."""
    home = cuda_home()
    if home is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA headers (cuda_runtime.h) to build the check")
    out = ROOT / "build" / "channel_attrs_check.so"
    out.parent.mkdir(exist_ok=True)
    # Written under this process's id, then renamed: the suite's workers
    # (conftest.py) may build it at the same time.
    mine = out.with_name(f"channel_attrs_check.{os.getpid()}.so")
    subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-I", str(ROOT / "csrc"),
                    "-I", str(ROOT), "-I", jax.ffi.include_dir(), "-I", os.path.join(home, "include"),
                    str(ROOT / "tests" / "native" / "channel_attrs_check.cc"), "-o", str(mine)],
                   check=True)
    os.replace(mine, out)
    lib = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target("pk_channel_attrs_check", jax.ffi.pycapsule(lib.ChannelCheck),
                                platform="cpu")
    return "pk_channel_attrs_check"


def _run(mesh, edit=lambda attr: attr):
    """Each device's decoded members (9 int64 values) of a call whose channel
    attribute pk_jax built for a gather over "x", after `edit`."""
    target = _target()
    prim = core.Primitive(f"pk_channel_attrs_check_{id(edit)}")
    prim.def_abstract_eval(lambda x: x.update(shape=(18,), dtype=jnp.uint32))

    def lower(ctx, x):
        table = _lowering.kernel_group(ctx, "all_gather", ("x",), mesh.shape["x"])
        attr = _lowering.channel_attr(table, "all_gather", "check", 12345)
        return jax.ffi.ffi_lowering(target)(ctx, x, extra=np.int32(7), **edit(attr))

    mlir.register_lowering(prim, lower, platform="cpu")
    f = jax.jit(jax.shard_map(lambda x: prim.bind(x), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x"), check_vma=False))
    words = np.asarray(f(jnp.zeros((mesh.size * 4,), jnp.uint32)), np.uint64).reshape(-1, 9, 2)
    return (words[..., 0] | (words[..., 1] << np.uint64(32))).astype(np.int64)


def test_every_member_reads_back(cuda_lowering):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    table = groups.axis_groups(mesh, ("x",))
    got = _run(mesh)
    ids = table.reshape(-1)
    region = _channels.size_class(12345)  # the region's size class holds the 12345 bytes
    want = [ids.size, int(np.sum(ids * np.arange(1, ids.size + 1))), 2, None, None, region,
            pk_jax.get_config().timeout_ns, -1, 7]
    for row in got:
        assert [v for v, w in zip(row, want) if w is not None] == [w for w in want
                                                                 if w is not None], row
        assert 0 <= row[3] < 256 and row[4] % _channels.REGION_ALIGN == 0  # an aligned region


@pytest.mark.parametrize("edit,message", [
    (lambda a: dict(channel=dict(a["channel"], skip_post_rank=np.int64(-1))), "S32"),
    (lambda a: dict(channel={k: v for k, v in a["channel"].items() if k != "data_bytes"}),
     "attributes"),
])
def test_bad_members_are_refused(cuda_lowering, edit, message):
    with pytest.raises(Exception, match=message):
        _run(cpu_mesh((2,), ("x",)), edit)
