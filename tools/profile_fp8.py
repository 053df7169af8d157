"""One call each of pk's scaled FP8 GEMMs (per-tensor and block factors), XLA's
FP8 dot (cuBLASLt) and XLA's bf16 dot on the same shape, between
cudaProfilerStart/Stop, for Nsight Compute's speed-of-light sections:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --csv python tools/profile_fp8.py

(each GEMM kernel's duration, SM clock, tensor-pipe and memory throughput:
whether a kernel is bound by the tensor pipe at the clock it ran at, or
loses issue slots elsewhere). The quantization kernels run before the
profiled region. Without ncu it prints each GEMM's median time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax

import pk_jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import cuda_profiler, interleaved_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,8192,8192", help="M,N,K")
    a = ap.parse_args()
    m, n, k = map(int, a.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (n, k), jnp.bfloat16) * k ** -0.5  # [N, K]: K-major B
    xq, _, fx, _ = pk_jax.fp8_quantize(x, "tensor")
    wq, _, fw, _ = pk_jax.fp8_quantize(w, "tensor")
    xb, _, fxb, _ = pk_jax.fp8_quantize(x, "rows")
    _, wb, fwb, _ = pk_jax.fp8_quantize(w.T, "blocks", rowwise=False, transposed=True)
    dims = (((1,), (1,)), ((), ()))

    def xla_fp8(a, b, sa, sb):  # the FP8 dot with the factors after: one cuBLASLt call
        return (lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
                * (sa * sb)).astype(jnp.bfloat16)

    calls = {
        "pk_fp8_tensor": (jax.jit(lambda a, b, sa, sb: pk_jax.fp8_matmul(a, b, sa, sb)),
                          (xq, wq, fx, fw)),
        "pk_fp8_block": (jax.jit(lambda a, b, sa, sb: pk_jax.fp8_matmul(
            a, b, sa, sb, scaling="block")), (xb, wb, fxb, fwb.T)),
        "xla_fp8": (jax.jit(xla_fp8), (xq, wq, fx.reshape(()), fw.reshape(()))),
        "xla_bf16": (jax.jit(lambda a, b: lax.dot_general(a, b, dims)), (x, w)),
    }
    for f, args in calls.values():
        jax.block_until_ready(f(*args))
    cuda_profiler(True)
    for f, args in calls.values():
        jax.block_until_ready(f(*args))
    cuda_profiler(False)
    times = interleaved_ms({name: (lambda f=f, args=args: f(*args))
                            for name, (f, args) in calls.items()}, rounds=2)
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{name}: median {ms:.3f} ms, {2.0 * m * n * k / ms / 1e9:.0f} TFLOP/s",
              flush=True)


if __name__ == "__main__":
    main()
