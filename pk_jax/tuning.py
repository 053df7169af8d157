"""Mechanism choices by shape that measurements decided (benchmarks/RESULTS.md
has the runs behind them). `mechanism="auto"` looks here; a user can force
any mechanism.
"""

from __future__ import annotations


def all_gather_mechanism(ll_eligible: bool) -> str:
    """The all_gather mechanism `auto` takes.

    On 2 x H200 the low-latency lines (one one-way trip, no handshake) were
    the fastest at every size they take (up to 16 KiB per rank: 5 us per call
    inside a program against 9 us for ld_st_push and 17 us for NCCL), and
    ld_st_push the fastest or level with ld_st_pull from 64 KiB to 256 MiB
    (1.3-1.6x NCCL); the copy engine never led.
    """
    return "ld_st_ll" if ll_eligible else "ld_st_push"


# The fused ring attention's mechanism under `auto`: copy_engine was faster
# than ld_st (16 communicator CTAs) by 3% at S_local 8192 and 16384
# non-causal and within 1% everywhere else measured (n = 2, S_local 8k-32k,
# causal and not), and it leaves every SM to the attention.
RING_ATTENTION_MECHANISM = "copy_engine"


# The MoE exchange's mechanism under `auto`: "ragged" (XLA's ragged_all_to_all
# under pk's layout; the dense equivalent on CPU). pk's "ld_st" exchange kernel
# has not been measured on two GPUs yet (benchmarks/moe.py has its rows).
MOE_MECHANISM = "ragged"
