"""Mechanism choices by shape that measurements decided (benchmarks/RESULTS.md
has the runs behind them). `mechanism="auto"` looks here; a user can force
any mechanism.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def all_gather_mechanism(ll_eligible: bool) -> str:
    """The all_gather mechanism `auto` takes.

    On 2 x H200 the low-latency lines (one one-way trip, no handshake) were
    the fastest at every size they take (up to 16 KiB per rank: 5 us per call
    inside a program against 9 us for ld_st_push and 17 us for NCCL), and
    ld_st_push the fastest or level with ld_st_pull from 64 KiB to 256 MiB
    (1.3-1.6x NCCL); the copy engine never led.
    """
    return "ld_st_ll" if ll_eligible else "ld_st_push"


def matmul_all_reduce_mechanism(rows: int, n: int) -> str:
    """The matmul_all_reduce mechanism `auto` takes for `rows` rows of x.

    PROVISIONAL: one_shot (each rank's whole partial product pushed to every
    peer, summed by every rank) up to 256 rows, where chunking the rows by
    rank leaves GEMMs too small to hide anything; chunked above (the
    reduce-scatter of the partials overlapped with the GEMMs, then the
    reduced chunks exchanged). Rows that do not divide by n take one_shot.
    Settled by `python benchmarks/tp_matmul.py --only matmul_all_reduce` on 2
    GPUs: its pk_chunked and pk_one_shot rows at M = 16..256 and 8192 give
    the crossover (MATMUL_ALL_REDUCE_ONE_SHOT_ROWS).
    """
    return "one_shot" if rows <= MATMUL_ALL_REDUCE_ONE_SHOT_ROWS or rows % n else "chunked"


MATMUL_ALL_REDUCE_ONE_SHOT_ROWS = 256

# The fused ring attention's mechanism under `auto`: copy_engine was faster
# than ld_st (16 communicator CTAs) by 3% at S_local 8192 and 16384
# non-causal and within 1% everywhere else measured (n = 2, S_local 8k-32k,
# causal and not), and it leaves every SM to the attention.
RING_ATTENTION_MECHANISM = "copy_engine"

# The ring attention's mechanism under `auto` where the fused kernel does not
# take the shapes (head dim 256, or 64/128 off its tiles) but cuDNN's blocks
# do: "cudnn" (each step one cuDNN flash-attention call, XLA's
# collective-permutes between the steps; ops/ring_attention/cudnn.py). The
# alternative there is the pure-JAX ring of einsums, which ran at 0.09-0.15x
# the same ring of cuDNN blocks on 2 x H200 (RESULTS.md ring_attention,
# einsum_ring against cudnn_ring rows, d128). Where the kernel takes the
# shapes it stays: on 2 GPUs its fwd+bwd was 0.96-1.01x the cuDNN ring
# (2026-11-30), and only it moves K/V with pk's transport.
RING_ATTENTION_UNFUSED = "cudnn"


# The ring attention backward's transport for the kernel mechanisms: "pk"
# (one fused call per backward: block kernels, copy-engine pushes and posted
# flags; ops/ring_attention/bwd_primitive.py) or "xla" (the block kernel per step
# with XLA collective-permutes between the steps, the path before the fused
# call; kept for comparison and as the fallback). PROVISIONAL: settled by
# `python benchmarks/ring_attention.py --backward --bwd-transport pk` against
# `--bwd-transport xla` on 2 GPUs (fwd+bwd rows, 16k and 32k).
RING_ATTENTION_BWD_TRANSPORT = "pk"


# all_reduce / reduce_scatter under `auto`. PROVISIONAL: the one-shot reads n
# times the bytes of the two-shot but takes one exchange, so it should lead
# for small messages. Settled by `python benchmarks/all_reduce.py` on 2 GPUs:
# the per-rank size where pk_two_shot overtakes pk_one_shot (host-timed and
# in-program latency columns) sets ALL_REDUCE_ONE_SHOT_MAX_BYTES.
ALL_REDUCE_ONE_SHOT_MAX_BYTES = 256 << 10


def all_reduce_mechanism(kind: str, per_rank_bytes: int) -> str:
    """The all_reduce / reduce_scatter mechanism `auto` takes (provisional)."""
    if kind == "all_reduce" and per_rank_bytes <= ALL_REDUCE_ONE_SHOT_MAX_BYTES:
        return "one_shot"
    return "two_shot"


def moe_mechanism(n: int) -> str:
    """The moe_dispatch / moe_combine mechanism `auto` takes on an expert
    axis of n devices.

    n >= 2: "ld_st", pk's exchange kernel (where it cannot run, the dense
    reference exchange). On one H200 it moved dispatch + combine in 0.36 ms
    where XLA's ragged_all_to_all ("ragged") took 50 ms (4096 tokens x 4096,
    top-2 of 8). To confirm across GPUs: `python benchmarks/moe.py --save`
    on 2 GPUs (pk against a2a_capacity and ragged_all_to_all).

    n == 1: "local": nothing crosses devices, so dispatch is one row kernel
    writing each token's row to its k rows (after the layout's kernel, one
    block, within its bounds) and combine one summing each token's rows
    where they lie. Measured on one H200 (`moe`, `moe_decode`,
    `moe_wide` in benchmarks/RESULTS.md, against the sort + gather a user
    writes there): dispatch 0.92-1.91x, dispatch + combine 0.99-1.53x, where
    pk's exchange kernel ran 0.83-0.93x and 0.47-0.79x (train and decode
    shapes): the fastest of pk's ways.
    """
    return "local" if n == 1 else "ld_st"


def single_gpu_gemm() -> str:
    """What the bf16/fp16 tensor-parallel matmuls run under `auto` on an axis
    of one device (nothing to gather or reduce): "kernel" (pk's CUTLASS GEMM
    sequences) or "xla" (XLA's dot, cuBLAS; its backward too).

    From benchmarks/RESULTS.md's kernels_gemm (one H100, five rotated
    rounds, the same run's XLA dot): pk's GEMM was 0.89-0.98x cuBLAS forward
    + backward over the 15 LLM shapes (forward alone 0.91-1.05x; an earlier
    H200 run: 0.93-1.00x and 0.95-1.04x), so one device runs XLA's dot, as a
    user without pk_jax would. `mechanism="chunked"` still runs the kernels
    there; the FP8 path (`fp8=`) keeps pk's FP8 GEMMs, which lead XLA's FP8
    dot (kernels_fp8).
    """
    return "xla"


FP8_GEMM_LIBRARIES = ("cutlass", "cublaslt")


def fp8_gemm_library(scaling: str, cublaslt_loaded: bool) -> str:
    """Who runs an FP8 GEMM of `scaling` ("tensor" or "block"), in pk_jax's
    own calls (`fp8_dot`, `fp8_matmul`, the TP ops' FP8 host sequences, the
    Flax FP8 layers): "cutlass" (pk's CUTLASS kernels) or "cublaslt"
    (NVIDIA's cuBLASLt, csrc/kernels/gemm/cublaslt.h; `cublaslt_loaded`:
    the extension was built with its header and found the library).

    Both run cuBLASLt where it is loaded. One H100 (benchmarks/NOTES.md,
    2026-12-06; RESULTS.md's kernels_fp8_h100 and kernels_fp8_train, the
    pk_fp8_* rows against pk_cutlass_fp8_*): at 8192^3 cuBLASLt's
    per-tensor GEMMs took 0.918 ms forward and 1.044 ms for the e5m2
    gradient against the CUTLASS kernels' 1.013 and 1.129, its block-scaled
    GEMM 0.977 against 1.107 ms; fp8_dot's training step was level with
    either (-5% to +6% per shape), the TP ops' FP8 step faster with it.
    """
    forced = _FORCED.get("fp8_gemm_library")
    if forced is not None:
        return forced
    return "cublaslt" if cublaslt_loaded else "cutlass"


SINGLE_GPU_ATTENTION_CHOICES = ("cudnn", "kernel", "kernel_fwd_cudnn_bwd")

# Where a ring of one device runs pk's kernel with its own block backward
# (single_gpu_attention): (head dim, causal, least GQA group (query heads per
# K/V head), first sequence length, first one past the range). Causal:
# measured at 2048 through 8192 tokens (16384 and 32768 slower). Full masks
# with groups of 4 or more: measured at 1024 through 8192 tokens.
SINGLE_GPU_ATTENTION_KERNEL_BWD = ((128, True, 1, 2048, 16384), (128, False, 4, 1024, 8193))

_FORCED: dict[str, str] = {}  # tuning.forced's choices


def single_gpu_attention(head_dim: int, causal: bool, seq: int, kernel_takes: bool,
                         group: int = 1) -> str:
    """What ring_attention under `auto` runs on a ring of one device (one GPU
    holding the whole sequence of `seq` tokens, no communication), where
    cuDNN takes the shapes: "cudnn" (cuDNN's fused attention and its
    backward, through jax.nn.dot_product_attention), "kernel" (pk's fused
    attention kernel and its block backward) or "kernel_fwd_cudnn_bwd" (pk's
    forward kernel, then cuDNN's backward fed the kernel's output and
    log-sum-exp).

    From benchmarks/RESULTS.md's kernels_attention (one H200, each row's three
    alternatives and cuDNN in the same run; a run on one H100 agreed,
    benchmarks/NOTES.md 2026-12-06): pk's forward kernel was 0.98-1.14x
    cuDNN's forward (0.95-1.05x the best of cuDNN and tokamax), so wherever
    the kernel takes the shapes the forward is pk's. Behind it cuDNN's
    backward gave 0.97-1.04x cuDNN's whole attention (forward + backward);
    pk's block backward 1.01-1.05x at head dim 128 causal with 8192 tokens
    (MHA and GQA, bf16 and fp16; cuDNN's backward there 0.996-1.018x) but
    0.90-1.00x at 4 x 4096, 16384 and 32768 tokens
    (SINGLE_GPU_ATTENTION_KERNEL_BWD). Since its causal launch in groups of
    (batch, K/V head) pairs (36402d1), pk's block backward behind pk's
    forward ran 1.02-1.05x cuDNN's at 8 x 2048 tokens (two runs) and 1.03x
    at 4 x 4096 (one H100, kernels_attention 2026-12-07; not yet run on an
    H200), so the causal range starts at 2048. Identical code measured up to 8%
    apart within that run, so choices closer than that rest on both GPUs
    agreeing. Under a full mask with GQA (`group` query heads per K/V head)
    pk's block backward, which sums dK and dV over the group in registers,
    ran 1.05-1.16x pk's forward with cuDNN's backward at groups of 4 and 8
    from 1024 to 8192 tokens, and 0.98-1.00x without GQA; under a causal
    mask with GQA 0.90-1.00x outside the range above (one H100, interleaved
    rounds, benchmarks/NOTES.md 2026-12-07; identical code there measured
    up to 5% apart, and all five full-mask GQA shapes agreed, 1.046x the
    least; not yet run on an H200). Shapes the kernel does not take run
    cuDNN.
    """
    forced = _FORCED.get("single_gpu_attention")
    if forced is not None:
        return forced
    if not kernel_takes:
        return "cudnn"
    for d, c, least_group, first, past in SINGLE_GPU_ATTENTION_KERNEL_BWD:
        if (head_dim, bool(causal)) == (d, c) and group >= least_group and first <= seq < past:
            return "kernel"
    return "kernel_fwd_cudnn_bwd"


def forced(**choices: str) -> contextlib.AbstractContextManager[None]:
    """For measurements: inside the block, each named choice function of
    this module returns the value given (programs traced inside keep it).
    benchmarks/kernels.py times single_gpu_attention's alternatives so:

        with tuning.forced(single_gpu_attention="kernel_fwd_cudnn_bwd"):
            jax.jit(f).lower(...)  # or a first call

    The choices are read while lowering, and JAX caches a function's
    lowering: lower a function object of its own inside the block (a new
    closure), never one that is also called outside it, or those calls run
    the forced choice too (and a function lowered before runs its old one).

    The choices are checked when `forced` is called (a ValueError naming a
    choice that is not forcible or a value it does not take), with or
    without the `with`.
    """
    allowed = {"single_gpu_attention": SINGLE_GPU_ATTENTION_CHOICES,
               "fp8_gemm_library": FP8_GEMM_LIBRARIES}
    for name, value in choices.items():
        if name not in allowed:
            raise ValueError(f"pk_jax.tuning.forced: {name!r} is not a forcible choice; "
                             f"choose from {sorted(allowed)}")
        if value not in allowed[name]:
            raise ValueError(f"pk_jax.tuning.forced: {name}={value!r}; choose from "
                             f"{allowed[name]}")
    return _forcing(choices)


@contextlib.contextmanager
def _forcing(choices: dict[str, str]) -> Iterator[None]:
    """`forced`'s block: the checked choices in _FORCED, the table before
    it restored on leaving."""
    before = dict(_FORCED)
    _FORCED.update(choices)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(before)
