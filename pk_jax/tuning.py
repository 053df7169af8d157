"""Mechanism choice by shape, from measured tables.

The tables hold what benchmarks/ measured on the named machine; see
benchmarks/RESULTS.md for the runs behind them. `mechanism="auto"` looks
here; a user can force any mechanism.
"""

from __future__ import annotations

import math

# all_gather on 2 x H200 (NV18): per-rank message bytes at and above which the
# copy engine beats the ld/st kernels. None: an ld/st kernel was fastest at
# every size measured, 8 KiB to 256 MiB (benchmarks/RESULTS.md).
ALL_GATHER_COPY_ENGINE_FROM_BYTES: int | None = None


def all_gather_mechanism(per_rank_bytes: int, group_size: int, workspace_bytes: int,
                         ll_eligible: bool) -> str:
    """The all_gather mechanism for one rank's message size.

    ll_eligible: the message fits the low-latency lines (size, alignment and
    channel); those one-way calls win wherever they apply (benchmarks/NOTES.md).
    """
    threshold = ALL_GATHER_COPY_ENGINE_FROM_BYTES
    fits = per_rank_bytes * group_size <= workspace_bytes
    if threshold is not None and per_rank_bytes >= threshold and fits:
        return "copy_engine"
    if ll_eligible:
        return "ld_st_ll"
    return "ld_st_push"


# ring_attention (fused kernel): (ring size n, S_local, causal) -> the kernel
# mechanism that was fastest there (2 x H200, b1 h16 kv16 d128 bf16,
# `python benchmarks/ring_attention.py --mechanisms copy_engine,ld_st`, rows
# pk_<layout>_<mechanism>; benchmarks/RESULTS.md "ring_attention"). ld_st (16
# communicator CTAs) was slower at S_local 8192 and 16384 non-causal (by 3%)
# and within +-1% elsewhere, so copy_engine, which leaves every SM to the
# attention, holds every entry. Causal entries were measured with zigzag.
RING_ATTENTION_MEASURED: dict[tuple[int, int, bool], str] = {
    (2, 8192, False): "copy_engine",
    (2, 8192, True): "copy_engine",
    (2, 16384, False): "copy_engine",
    (2, 16384, True): "copy_engine",
    (2, 32768, False): "copy_engine",
    (2, 32768, True): "copy_engine",
}
RING_ATTENTION_DEFAULT = "copy_engine"  # where nothing with this (n, causal) was measured


def ring_attention_mechanism(n: int, s_local: int, causal: bool) -> str:
    """The kernel mechanism `mechanism="auto"` takes: the measured entry of
    the same ring size and mask whose S_local is nearest (ratio), else the
    default."""
    rows = [(abs(math.log2(s / max(s_local, 1))), mech)
            for (nn, s, c), mech in RING_ATTENTION_MEASURED.items() if nn == n and c == causal]
    return min(rows)[1] if rows else RING_ATTENTION_DEFAULT
