"""One world-size-1 GEMM forward + backward of pk's all_gather_matmul (its
CUTLASS GEMMs: the forward, then dx = dy w^T and dw = x^T dy in one call) and
one of XLA's dot, between cudaProfilerStart/Stop, for Nsight Compute. Each
kernel's time, SM clock and tensor-pipe activity (whether it is bound by the
tensor cores at the clock it ran at):

    XLA_PYTHON_CLIENT_PREALLOCATE=false \
    ncu --profile-from-start off --clock-control none --metrics \
        gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,\
        sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed \
        python tools/profile_gemm.py [--shape M,N,K] [--fp8 tensor|block]

(On the H200 machine this set ran every time; the duration metric alone, or
with the clock's, crashed the profiled process at start: benchmarks/NOTES.md,
2026-12-04.) `--fp8 tensor|block` profiles the FP8 GEMM forward instead:
pk_jax.fp8_matmul on operands quantized beforehand (per-tensor or 1x128 /
128x128 factors) and XLA's dot of the same e4m3 operands written the two
fastest ways (kernels.py's xla_fp8_direct and xla_fp8_dq_f32). `--cutlass` adds
pk's CUTLASS kernel of the same recipe beside the default library's
(`pk_cutlass_fp8_<recipe>`, tuning.forced, lowered from a function of its
own); `--b-row-blocks` gives the block recipe's B 1x128 factors too (the
weight gradient's operands).

Without ncu it prints the timings (benchmarks/common.py's interleaved_ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import tuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import cuda_profiler, interleaved_ms, one_axis_mesh  # noqa: E402
from kernels import _xla_fp8_variants  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,8192,8192", help="M,N,K")
    ap.add_argument("--fp8", choices=("tensor", "block"), default=None,
                    help="profile the FP8 GEMM forward with this recipe's factors")
    ap.add_argument("--cutlass", action="store_true",
                    help="with --fp8: pk's CUTLASS kernel beside the default library's")
    ap.add_argument("--b-row-blocks", action="store_true",
                    help="with --fp8 block: B per 1x128 too (the weight gradient's factors)")
    a = ap.parse_args()
    if (a.cutlass or a.b_row_blocks) and not a.fp8:
        ap.error("--cutlass and --b-row-blocks profile an FP8 GEMM: give --fp8 too")
    if a.b_row_blocks and a.fp8 != "block":
        ap.error("--b-row-blocks is the block recipe's: give --fp8 block")
    m, n, k = map(int, a.shape.split(","))
    if a.fp8:
        return profile(fp8_calls(m, n, k, a.fp8, cutlass=a.cutlass,
                                 b_row_blocks=a.b_row_blocks), "forward")
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * k ** -0.5
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    mesh = one_axis_mesh(jax.devices()[:1])
    pk = jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "x", mechanism="chunked"),
                       mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    fns = {name: jax.jit(lambda x, w, dy, f=f: jax.vjp(f, x, w)[1](dy))
           for name, f in (("pk", pk), ("xla", lambda x, w: x @ w))}
    profile({name: (lambda f=f: f(x, w, dy)) for name, f in fns.items()}, "backward (dx, dw)")


def fp8_calls(m: int, n: int, k: int, recipe: str, *, cutlass: bool = False,
              b_row_blocks: bool = False) -> dict[str, Callable[[], jax.Array]]:
    """pk's FP8 GEMM with `recipe`'s factors (and, with `cutlass`, pk's CUTLASS
    kernel of it) and XLA's two fastest FP8 dots."""
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (n, k), jnp.bfloat16) * k ** -0.5
    if recipe == "tensor":
        xq, _, fx, _ = pk_jax.fp8_quantize(x, "tensor")
        wq, _, fw, _ = pk_jax.fp8_quantize(w, "tensor")
    else:
        xq, _, fx, _ = pk_jax.fp8_quantize(x, "rows")
        if b_row_blocks:
            wq, _, fw, _ = pk_jax.fp8_quantize(w, "rows")
        else:
            _, wq, fw, _ = pk_jax.fp8_quantize(w.T, "blocks", rowwise=False, transposed=True)

    def gemm():  # a new function each call: JAX caches lowerings (benchmarks/NOTES.md, 2026-12-06)
        return jax.jit(lambda a, b, fa, fb: pk_jax.fp8_matmul(
            a, b, fa, fb, scaling=recipe, b_row_blocks=b_row_blocks))
    pk = gemm()
    tq, _, tx, _ = pk_jax.fp8_quantize(x, "tensor")
    uq, _, tw, _ = pk_jax.fp8_quantize(w, "tensor")
    sx, sw = tx.reshape(()), tw.reshape(())
    xla = _xla_fp8_variants()
    calls = {f"pk_fp8_{recipe}": lambda: pk(xq, wq, fx, fw)}
    if cutlass:
        with tuning.forced(fp8_gemm_library="cutlass"):
            cut = gemm().lower(xq, wq, fx, fw).compile()
        calls[f"pk_cutlass_fp8_{recipe}"] = lambda: cut(xq, wq, fx, fw)
    for name in ("xla_fp8_direct", "xla_fp8_dq_f32"):
        calls[name] = lambda f=jax.jit(xla[name]): f(tq, uq, sx, sw)
    return calls


def profile(calls: dict[str, Callable[[], jax.Array]], what: str) -> None:
    """Each call once between cudaProfilerStart/Stop (after a warm-up), then timed."""
    for f in calls.values():
        jax.block_until_ready(f())
    cuda_profiler(True)
    for f in calls.values():
        jax.block_until_ready(f())
    cuda_profiler(False)
    times = interleaved_ms(calls, rounds=2)
    for name, ts in times.items():
        print(f"{name}: {what} median {statistics.median(ts):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
