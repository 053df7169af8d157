"""One fwd+bwd of pk's ring attention on one GPU (its own kernels: mechanism
copy_engine by default) and one of cuDNN's attention, between
cudaProfilerStart/Stop, for Nsight Compute (the metric set of
tools/profile_gemm.py's docstring, which ran on the H200 machine):

    XLA_PYTHON_CLIENT_PREALLOCATE=false \
    ncu --profile-from-start off --clock-control none --metrics \
        gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,\
        sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed \
        python tools/profile_attention_bwd.py [--causal]   # every kernel

Without ncu it first times both fwd+bwd in `--rounds` interleaved rounds
(benchmarks/common.py's interleaved_ms: each the median of batches of
back-to-back calls), so clock drift over the run moves both alike: one line
per round with cuDNN time / pk time, then the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pk_jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import cuda_profiler, interleaved_ms  # noqa: E402




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mechanism", default="copy_engine",
                    help="ring_attention's mechanism: copy_engine (pk's kernels) or auto "
                         "(cuDNN on one device)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per batch")
    a = ap.parse_args()
    hkv = a.kv_heads or a.heads
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, a.seq, a.heads, a.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, a.seq, hkv, a.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, a.seq, hkv, a.head_dim), jnp.bfloat16)
    w = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = P(None, "sp")

    def pk_loss(q, k, v):
        f = jax.shard_map(lambda q, k, v: pk_jax.ring_attention(
            q, k, v, "sp", causal=a.causal, mechanism=a.mechanism),
                          mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jnp.sum(f(q, k, v).astype(jnp.float32) * w)

    def cudnn_loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=a.causal, implementation="cudnn")
        return jnp.sum(o.astype(jnp.float32) * w)

    fns = {name: jax.jit(jax.grad(f, argnums=(0, 1, 2)))
           for name, f in (("pk", pk_loss), ("cudnn", cudnn_loss))}
    def report(r, ms):
        print(f"round {r}: pk {ms['pk']:.3f} ms, cudnn {ms['cudnn']:.3f} ms, "
              f"cudnn/pk {ms['cudnn'] / ms['pk']:.3f}", flush=True)

    times = interleaved_ms({name: (lambda f=f: f(q, k, v)) for name, f in fns.items()},
                           rounds=a.rounds, calls=a.calls, on_round=report)
    for name, ts in times.items():
        print(f"{name}: fwd+bwd median {statistics.median(ts):.3f} ms (min {min(ts):.3f})",
              flush=True)
    ratios = [c / p for c, p in zip(times["cudnn"], times["pk"])]
    print(f"cudnn/pk median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f})", flush=True)
    cuda_profiler(True)
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))
    cuda_profiler(False)


if __name__ == "__main__":
    main()
