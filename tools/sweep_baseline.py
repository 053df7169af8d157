"""What a user runs without pk_jax, timed at a tile sweep's shapes (tools/sweep.sh):
XLA's dot (cuBLAS) for gemm_sweep's M,N,K; cuDNN's fused attention
(jax.nn.dot_product_attention, implementation="cudnn") for attention_sweep's
B,S,HQ,HKV,D,CAUSAL; bf16, with benchmarks/common.py's timing loop. One line per
shape: the name, the shape, ms and TFLOP/s.

Usage: python3 tools/sweep_baseline.py gemm_sweep|attention_sweep SHAPE ...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import time_ms  # noqa: E402


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.bfloat16)


def gemm(m: int, n: int, k: int) -> tuple[str, float, float]:
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a, b = _normal(ka, (m, k)), _normal(kb, (k, n))
    dot = jax.jit(lambda a, b: a @ b)
    ms = time_ms(lambda: dot(a, b), calls=20)
    return f"xla {m}x{n}x{k}", ms, 2 * m * n * k / ms / 1e9


def attention(b: int, s: int, hq: int, hkv: int, d: int, causal: int) -> tuple[str, float, float]:
    kq, kk, kv = jax.random.split(jax.random.key(b + s + hq + d), 3)
    q, k, v = _normal(kq, (b, s, hq, d)), _normal(kk, (b, s, hkv, d)), _normal(kv, (b, s, hkv, d))
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=bool(causal), implementation="cudnn"))
    ms = time_ms(lambda: f(q, k, v), calls=20)
    flops = 4 * b * s * s * hq * d * (0.5 if causal else 1.0)
    mask = "causal" if causal else "full"
    return f"cudnn {b}, {s}, {hq}/{hkv}, {d}, {mask}", ms, flops / ms / 1e9


BASELINES = {"gemm_sweep": gemm, "attention_sweep": attention}


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in BASELINES:
        print(f"usage: sweep_baseline.py {'|'.join(BASELINES)} SHAPE ...", file=sys.stderr)
        return 2
    for shape in argv[1:]:
        name, ms, tflops = BASELINES[argv[0]](*map(int, shape.split(",")))
        print(f"{name}: {ms:.3f} ms, {tflops:.0f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
