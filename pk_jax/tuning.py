"""Mechanism choice by shape, from measured tables.

The tables hold what benchmarks/ measured on the named machine; see
benchmarks/RESULTS.md for the runs behind them. `mechanism="auto"` looks
here; a user can force any mechanism.
"""

from __future__ import annotations

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
