#!/usr/bin/env bash
# Tile configurations and swizzles of the sm90 GEMMs, bf16 and FP8 (tools/gemm_sweep),
# on one GPU, then XLA's dot (cuBLAS) at the same shapes in the same call, to pick
# the GEMMs' tiles per shape. The binary: tools/sweep_build.sh (PK_SWEEP_BIN runs
# one built earlier, PK_SWEEP_BUILD_ONLY only builds it).
# Usage: tools/gemm_sweep.sh [M,N,K ...]; output in $OUT/gemm_sweep.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
BIN=$(tools/sweep_build.sh gemm_sweep)
[ -n "$BIN" ] || exit 0  # PK_SWEEP_BUILD_ONLY: built and copied
"$BIN" "$@" | tee "$OUT/gemm_sweep.log"
# XLA's dot at the same shapes (the same timing loop as benchmarks/common.py).
python3 - "$@" <<'PY' | tee -a "$OUT/gemm_sweep.log"
import sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from common import time_ms
shapes = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [  # main.cu's M, N, K
    (8192, 8192, 8192), (4096, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336),
    (8192, 6144, 4096), (8192, 28672, 8192), (8192, 8192, 28672), (8192, 3584, 8192),
    (8192, 8192, 3584), (8192, 18432, 7168), (2048, 14336, 4096)]
dot = jax.jit(lambda a, b: a @ b)
for m, n, k in shapes:
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    ms = time_ms(lambda: dot(a, b), calls=20)
    print(f"xla {m}x{n}x{k}: {ms:.3f} ms, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s")
PY
