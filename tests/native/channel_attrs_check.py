"""Builds channel_attrs_check.cc (g++, the jax wheel's FFI headers, the CUDA
headers) and lowers a call with a `channel` dictionary attribute through
jax.ffi.ffi_lowering on CPU, as the pk_jax lowerings do: the handler must read
every member back, and refuse a member of the wrong type or a missing one.
Usage: python tests/native/channel_attrs_check.py (prints OK, exit code 0)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend import core  # noqa: E402
from jax.interpreters import mlir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_include() -> str:
    for base in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
                 os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc") or "")))]:
        if base and os.path.exists(os.path.join(base, "include", "cuda_runtime.h")):
            return os.path.join(base, "include")
    import glob
    found = sorted(glob.glob("/usr/local/cuda*/include/cuda_runtime.h"))
    if not found:
        sys.exit("no cuda_runtime.h found (set CUDA_HOME)")
    return os.path.dirname(found[-1])


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    lib_path = os.path.join(tempfile.mkdtemp(), "libchannel_attrs_check.so")
    subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w",
                    "-I", os.path.join(ROOT, "csrc"), "-I", ROOT, "-I", jax.ffi.include_dir(),
                    "-I", _cuda_include(),
                    os.path.join(ROOT, "tests", "native", "channel_attrs_check.cc"),
                    "-o", lib_path], check=True)
    lib = ctypes.cdll.LoadLibrary(lib_path)
    jax.ffi.register_ffi_target("pk_channel_attrs_check", jax.ffi.pycapsule(lib.ChannelCheck),
                                platform="cpu")

    channels = {}
    prim = core.Primitive("pk_channel_attrs_check")
    prim.def_abstract_eval(lambda x, **_: jax.core.ShapedArray((9,), jnp.int64))
    mlir.register_lowering(
        prim, lambda ctx, x, *, key: jax.ffi.ffi_lowering("pk_channel_attrs_check")(
            ctx, x, channel=channels[key], extra=np.int32(7)), platform="cpu")

    def run(key):
        fn = jax.jit(lambda x: prim.bind(x, key=key))
        return np.asarray(fn(jnp.zeros(3, jnp.int64))).tolist()

    ids = np.array([4, 5, 6, 7], np.int64)
    channels["good"] = dict(group_ids=ids, group_size=np.int64(2), slot=np.int64(3),
                            data_offset=np.int64(1 << 40), data_bytes=np.int64(12345),
                            timeout_ns=np.int64(5_000_000_000), skip_post_rank=np.int32(-1))
    want = [4, 4 * 1 + 5 * 2 + 6 * 3 + 7 * 4, 2, 3, 1 << 40, 12345, 5_000_000_000, -1, 7]
    got = run("good")
    assert got == want, (got, want)
    channels["wrong type"] = dict(channels["good"], skip_post_rank=np.int64(-1))
    channels["missing"] = {k: v for k, v in channels["good"].items() if k != "data_bytes"}
    for key, message in [("wrong type", "expected S32"), ("missing", "expected 7 attributes")]:
        try:
            run(key)
        except Exception as e:  # XlaRuntimeError
            assert message in str(e), str(e)
        else:
            raise AssertionError(f"a channel with a {key} member was accepted")
    print("OK")


if __name__ == "__main__":
    main()
