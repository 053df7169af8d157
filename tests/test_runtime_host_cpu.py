"""The native runtime's host side without a GPU (tests/native/runtime_host_check.cc):
PCI bus id parsing, the bounded waits behind check_errors()/reset (a job that
hangs, overlapping requests, several waiters), and every runtime call where
CUDA finds no device returning a message instead of crashing."""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess

import pytest

from conftest import cuda_home

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_runtime_host_checks(tmp_path):
    cuda = cuda_home("lib*/libcudart_static.a")
    if cuda is None or not os.path.exists(os.path.join(cuda, "include", "cuda_runtime.h")) \
            or shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA toolkit (headers and libcudart_static)")
    lib = os.path.dirname(glob.glob(os.path.join(cuda, "lib*", "libcudart_static.a"))[0])
    exe = tmp_path / "runtime_host_check"
    runtime = sorted(str(p) for p in (ROOT / "csrc/runtime").glob("*.cc"))
    subprocess.run(["g++", "-std=c++17", "-O1", "-pthread", "-I", str(ROOT / "csrc"), "-I",
                    str(ROOT), "-I", os.path.join(cuda, "include"),
                    str(ROOT / "tests/native/runtime_host_check.cc"), *runtime,
                    "-L", lib, "-lcudart_static", "-ldl", "-lrt", "-o", str(exe)], check=True)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "runtime host checks passed" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
