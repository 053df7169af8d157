"""The ring attention kernel's K/V walk (csrc/kernels/ring_attention/kv_walk.cuh),
compiled for the host and run on every geometry class the kernel takes: it
must visit exactly the tiles with a visible key, once each, in posting order,
mask every tile that needs it, and place tokens exactly where the reference
ring (pk_jax/reference.py) does. The same checker runs the
push layout (PushLayout: where both mechanisms write a block in the peers'
regions) against the rows the walk reads. Key tiles that do not divide a
chunk (176 keys) are walked too: each chunk's last tile ends at the chunk's
end with the keys before it masked."""

from __future__ import annotations

import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax.reference import positions as _positions
from conftest import build_native, mutated_header


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return build_native("kv_walk_check.cc", tmp_path_factory.mktemp("kv_walk") / "kv_walk_check")


def _run(exe, n, s_local, zigzag, causal, tile_q=128, tile_k=128):
    res = subprocess.run([exe, str(n), str(s_local), str(int(zigzag)), str(int(causal)),
                          str(tile_q), str(tile_k)], capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines[-1] == "OK", lines[-1] if lines else res.stderr
    return {int(l.split()[1]): np.array(l.split()[2:], int) for l in lines if l.startswith("tokens")}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_local,tile_k", [(256, 128), (512, 64), (1024, 128),
                                            (1024, 176), (512, 192), (1024, 80)])
def test_walk(checker, n, zigzag, causal, s_local, tile_k):
    tokens = _run(checker, n, s_local, zigzag, causal, 128, tile_k)
    layout = "zigzag" if zigzag else "contiguous"
    for rank, got in tokens.items():
        want = np.asarray(_positions(jnp.int32(rank), n, s_local, layout))
        np.testing.assert_array_equal(got, want)


def _broken_run(tmp_path, old: str, new: str, args=("2", "256", "1", "1"), tile_k="128"):
    """The checker built against a kv_walk.cuh with `old` replaced by `new`,
    run on one geometry (n, s_local, zigzag, causal; 128-row query tiles)."""
    inc = mutated_header(tmp_path, "kernels/ring_attention/kv_walk.cuh", old, new)
    exe = build_native("kv_walk_check.cc", tmp_path / "broken", (inc,), opt="-O0")
    return subprocess.run([exe, *args, "128", tile_k], capture_output=True, text=True)


def test_checker_catches_a_broken_walk(tmp_path):
    """The checker must fail when the walk is wrong: a walk that forgets the
    mask flag."""
    res = _broken_run(tmp_path, "(g_.causal && t.token", "(false && t.token")
    assert res.returncode == 1 and "mask missing" in res.stdout


@pytest.mark.parametrize("old,new,error", [
    # the last tile of a chunk left where the tiles before it would put it
    ("rows - tile_k_;", "next_key;", "tile reads past its chunk"),
    # the keys the tile before it covered counted again
    ("t.skip = next_key - offset;", "t.skip = 0;", "key covered twice"),
])
def test_checker_catches_a_broken_last_tile(tmp_path, old, new, error):
    """Key tiles that do not divide the chunk (176 keys of 512): the checker
    fails when the last tile reads past the chunk or repeats covered keys."""
    res = _broken_run(tmp_path, old, new, args=("2", "1024", "1", "0"), tile_k="176")
    assert res.returncode == 1 and error in res.stdout


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


# ---- 64-bit offsets ----------------------------------------------------------
# Shapes where 32-bit products wrap: q's batch stride s_local * Hq * D and the
# peers' K/V batch stride (n - 1) * s_local * Hkv * D reach 2^31 elements, and
# the byte offsets of the pushes pass 2^32.
HUGE = [  # n, s_local, batch, hq, hkv, d
    (1, 131072, 1, 128, 128, 128),
    (8, 131072, 2, 128, 32, 128),
    (16, 65536, 3, 64, 64, 64),
    (2, 262144, 2, 64, 8, 128),
]


def _offsets(exe, *args):
    res = subprocess.run([exe, *map(str, args)], capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines[-1] == "OK", res.stdout + res.stderr
    return {k: int(v) for k, v in (line.split() for line in lines[:-1])}


@pytest.fixture(scope="module")
def offsets_checker(tmp_path_factory):
    return build_native("offsets_check.cc", tmp_path_factory.mktemp("offsets") / "offsets_check")


@pytest.mark.parametrize("n,s_local,batch,hq,hkv,d", HUGE)
def test_offsets_are_exact_at_64_bit_sizes(offsets_checker, n, s_local, batch, hq, hkv, d):
    """TensorStrides (the attention kernels' q/out/dq and peers' K/V strides)
    and PushLayout (where the pushes write) match exact integer arithmetic at
    sizes whose 32-bit products wrap, and every pushed element is where the
    kernel reads it (the checker's own comparison)."""
    got = _offsets(offsets_checker, n, s_local, batch, hq, hkv, d)
    row_bytes = s_local * hkv * d * 2
    want = {
        "q_row": hq * d, "q_head": d, "q_batch": s_local * hq * d,
        "peers_batch": max(n - 1, 1) * s_local * hkv * d if n > 1 else 0,
        "q_last": batch * s_local * hq * d - 1,
        "pitch": (n - 1) * row_bytes, "v_offset": batch * (n - 1) * row_bytes,
        "last_slot": (n - 2) * row_bytes + (batch - 1) * (n - 1) * row_bytes,
    }
    if n == 1:  # no peers: the checker prints the degenerate values
        want["peers_batch"], want["last_slot"] = 0, got["last_slot"]
    assert got == want


def test_offset_shapes_cover_the_wrap():
    """The shapes above are the ones the kernels' former `int` strides got
    wrong: q's and the peers' K/V batch strides (elements) and the push
    offsets (bytes) each pass 32 bits somewhere."""
    assert any(s * hq * d >= 2**31 for _, s, _, hq, _, d in HUGE)
    assert any((n - 1) * s * hkv * d >= 2**31 for n, s, _, _, hkv, d in HUGE)
    assert any(b * (n - 1) * s * hkv * d * 2 >= 2**32 for n, s, b, _, hkv, d in HUGE)
