#!/usr/bin/env bash
# Forward configurations of the fused ring attention kernel (keys per tile, K/V
# stages, persistent CTAs, lazy rescale; head dims 64, 128, 256:
# tools/attention_sweep/config.cu) on one GPU, bf16, then
# cuDNN's fused attention (jax.nn.dot_product_attention, implementation="cudnn")
# at the same shapes in the same call, to pick the kernel's tile per shape class.
# The binary: tools/sweep_build.sh (PK_SWEEP_BIN runs one built earlier,
# PK_SWEEP_BUILD_ONLY only builds it). Usage: tools/attention_sweep.sh
# [B,S,HQ,HKV,D,CAUSAL ...]; output in $OUT/attention_sweep.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
BIN=$(tools/sweep_build.sh attention_sweep)
[ -n "$BIN" ] || exit 0  # PK_SWEEP_BUILD_ONLY: built and copied
"$BIN" "$@" | tee "$OUT/attention_sweep.log"
# cuDNN at the same shapes (the same timing loop as benchmarks/common.py).
python3 - "$@" <<'PY' | tee -a "$OUT/attention_sweep.log"
import sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from common import time_ms
shapes = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [  # main.cu's
    (1, 8192, 16, 16, 128, 0), (1, 8192, 16, 16, 128, 1), (1, 16384, 16, 16, 64, 1),
    (1, 16384, 16, 16, 64, 0), (1, 32768, 8, 8, 128, 1), (1, 8192, 32, 8, 128, 1),
    (4, 4096, 16, 16, 128, 1), (1, 8192, 8, 8, 256, 1), (1, 8192, 8, 8, 256, 0)]
for b, s, hq, hkv, d, causal in shapes:
    kq, kk, kv = jax.random.split(jax.random.key(b + s + hq + d), 3)
    q = jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v, c=bool(causal): jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="cudnn"))
    ms = time_ms(lambda: f(q, k, v), calls=20)
    tflops = 4 * b * s * s * hq * d * (0.5 if causal else 1.0) / ms / 1e9
    mask = "causal" if causal else "full"
    print(f"cudnn {b}, {s}, {hq}/{hkv}, {d}, {mask}: {ms:.3f} ms, {tflops:.0f} TFLOP/s")
PY
