"""The block backward kernel's query-tile walk
(csrc/kernels/attention_bwd/bwd_walk.cuh), compiled for the host: for every
K/V tile of every (query rank, K/V rank) pair it must visit exactly the
(head, query tile) pairs with a visible key, once each, heads outer, flag
for masking exactly the tiles that are not wholly visible, and place tokens
where the reference ring's `positions` does."""

from __future__ import annotations

import functools
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax.reference import positions as _positions
from conftest import build_native, mutated_header

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "tests", "native", "bwd_walk_check.cc")


def _build(include: str, exe: str) -> str:
    return build_native("bwd_walk_check.cc", exe, (include,))


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return _build(os.path.join(ROOT, "csrc"), str(tmp_path_factory.mktemp("bwd") / "check"))


@functools.lru_cache(maxsize=None)
def _pos(rank, n, rows, layout):
    return np.asarray(_positions(jnp.int32(rank), n, rows, layout))


def _walk(exe, *args):
    res = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, check=True)
    walks = {}
    for line in res.stdout.strip().splitlines():
        f = line.split()
        walks[int(f[1])] = (int(f[2]), [tuple(int(x) for x in t.split(",")) for t in f[3:]])
    return walks


def _problems(exe, n, s_q, s_kv, zigzag, causal, group, tq, tkv, q_rank, k_rank):
    layout = "zigzag" if zigzag else "contiguous"
    walks = _walk(exe, n, s_q, s_kv, int(zigzag), int(causal), group, tq, tkv, q_rank, k_rank)
    q_pos, k_pos = _pos(q_rank, n, s_q, layout), _pos(k_rank, n, s_kv, layout)
    bad = []
    assert sorted(walks) == list(range(s_kv // tkv))
    for t, (k_first, got) in walks.items():
        kp = k_pos[t * tkv:(t + 1) * tkv]
        if k_first != kp[0] or not np.array_equal(kp, kp[0] + np.arange(tkv)):
            bad.append(f"kv tile {t}: first token {k_first}, reference {kp[:2]}...")
        want = []
        for h in range(group):
            for m in range(s_q // tq):
                qp = q_pos[m * tq:(m + 1) * tq]
                vis = qp[:, None] >= kp[None, :] if causal else np.ones((tq, tkv), bool)
                if vis.any():
                    want.append((h, m, int(qp[0]), int(not vis.all())))
        if got != want:
            bad.append(f"kv tile {t}: walk {got[:4]}..., want {want[:4]}...")
    return bad


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_kv,tq,group", [(256, 256, 128, 1), (512, 256, 64, 3),
                                               (256, 1024, 64, 2)])
def test_walk_every_rank_pair(checker, n, zigzag, causal, s_q, s_kv, tq, group):
    for q_rank in range(n):
        for k_rank in range(n):
            bad = _problems(checker, n, s_q, s_kv, zigzag, causal, group, tq, 128, q_rank, k_rank)
            assert not bad, f"q_rank {q_rank} k_rank {k_rank}: {bad[:3]}"


def test_checker_catches_a_broken_walk(tmp_path):
    """The comparison must fail against a walk that forgets the mask flag."""
    inc = mutated_header(tmp_path, "kernels/attention_bwd/bwd_walk.cuh",
                         "masked = causal_ &&", "masked = false &&")
    exe = _build(str(inc), str(tmp_path / "broken"))
    assert _problems(exe, 2, 256, 256, True, True, 1, 128, 128, 1, 1)
