"""One world-size-1 GEMM forward + backward of pk's all_gather_matmul (its
CUTLASS GEMMs: the forward, then dx = dy w^T and dw = x^T dy in one call) and
one of XLA's dot, between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none \
        --metrics gpu__time_duration.sum python tools/profile_gemm.py   # each kernel's time

Without ncu it prints the two timings (benchmarks/common.py's interleaved_ms).
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
from common import cuda_profiler, interleaved_ms, one_axis_mesh  # noqa: E402




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,8192,8192", help="M,N,K")
    a = ap.parse_args()
    m, n, k = map(int, a.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * k ** -0.5
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    mesh = one_axis_mesh(jax.devices()[:1])
    pk = jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "x"), mesh=mesh,
                       in_specs=(P("x"), P()), out_specs=P("x"))
    fns = {name: jax.jit(lambda x, w, dy, f=f: jax.vjp(f, x, w)[1](dy))
           for name, f in (("pk", pk), ("xla", lambda x, w: x @ w))}
    for f in fns.values():
        jax.block_until_ready(f(x, w, dy))
    cuda_profiler(True)
    for f in fns.values():
        jax.block_until_ready(f(x, w, dy))
    cuda_profiler(False)
    times = interleaved_ms({name: (lambda f=f: f(x, w, dy)) for name, f in fns.items()},
                           rounds=2)
    for name, ts in times.items():
        print(f"{name}: backward (dx, dw) median {statistics.median(ts):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
