"""The ring attention kernel's K/V walk (csrc/kernels/ring_attention/kv_walk.cuh),
compiled for the host and run on every geometry class the kernel takes: it
must visit exactly the tiles with a visible key, once each, in posting order,
mask every tile that needs it, and place tokens exactly where the reference
ring (pk_jax/reference.py) does. The same checker runs the
push layout (PushLayout: where both mechanisms write a block in the peers'
regions) against the rows the walk reads."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax.reference import positions as _positions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the walk checker")
    exe = str(tmp_path_factory.mktemp("kv_walk") / "kv_walk_check")
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "native", "kv_walk_check.cc"), "-o", exe],
                   check=True)
    return exe


def _run(exe, n, s_local, zigzag, causal, tile_q=128, tile_k=128):
    res = subprocess.run([exe, str(n), str(s_local), str(int(zigzag)), str(int(causal)),
                          str(tile_q), str(tile_k)], capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines[-1] == "OK", lines[-1] if lines else res.stderr
    return {int(l.split()[1]): np.array(l.split()[2:], int) for l in lines if l.startswith("tokens")}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_local,tile_k", [(256, 128), (512, 64), (1024, 128)])
def test_walk(checker, n, zigzag, causal, s_local, tile_k):
    tokens = _run(checker, n, s_local, zigzag, causal, 128, tile_k)
    layout = "zigzag" if zigzag else "contiguous"
    for rank, got in tokens.items():
        want = np.asarray(_positions(jnp.int32(rank), n, s_local, layout))
        np.testing.assert_array_equal(got, want)


def _broken_run(tmp_path, old: str, new: str, args=("2", "256", "1", "1")):
    """The checker built against a kv_walk.cuh with `old` replaced by `new`,
    run on one geometry (n, s_local, zigzag, causal; 128-row tiles)."""
    src = open(os.path.join(ROOT, "csrc", "kernels", "ring_attention", "kv_walk.cuh")).read()
    broken = src.replace(old, new)
    assert broken != src
    inc = tmp_path / "kernels" / "ring_attention"
    inc.mkdir(parents=True)
    (inc / "kv_walk.cuh").write_text(broken)
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the walk checker")
    exe = str(tmp_path / "broken")
    subprocess.run([cxx, "-std=c++17", "-I", str(tmp_path),
                    os.path.join(ROOT, "tests", "native", "kv_walk_check.cc"), "-o", exe],
                   check=True)
    return subprocess.run([exe, *args, "128", "128"], capture_output=True, text=True)


def test_checker_catches_a_broken_walk(tmp_path):
    """The checker must fail when the walk is wrong: a walk that forgets the
    mask flag."""
    res = _broken_run(tmp_path, "t.masked = g_.causal &&", "t.masked = false &&")
    assert res.returncode == 1 and "mask missing" in res.stdout


def test_checker_catches_a_misplaced_push(tmp_path):
    """The push-layout check must fail when a sender writes the wrong slot."""
    res = _broken_run(tmp_path, "return size_t(k - 1) * row_bytes +",
                      "return size_t(k % (n - 1)) * row_bytes +", args=("3", "256", "0", "0"))
    assert res.returncode == 1 and "pushed row misplaced" in res.stdout


def test_checker_catches_a_broken_piece_plan(tmp_path):
    """... and when a piece would copy rows another piece is waited for: a
    plan whose pieces copy to the end of every head."""
    res = _broken_run(tmp_path, "r1 = u1 < s_local ? u1 : s_local;", "r1 = s_local;")
    assert res.returncode == 1 and "FAIL plan" in res.stdout
