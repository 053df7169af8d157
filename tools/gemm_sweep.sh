#!/usr/bin/env bash
# Tile configurations and swizzles of the sm90 GEMM (tools/gemm_sweep) on one
# GPU, then XLA's dot (cuBLAS) at the same shapes in the same call, to pick
# the GEMM's tiles per shape. Needs nvcc and the nvidia-cutlass headers (on the
# GPU machine: after tools/gpu_check.sh, which installs them into /tmp/site).
# Usage: tools/gemm_sweep.sh [M,N,K ...]; output in $OUT/gemm_sweep.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
C=$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); \
print(os.path.join(s.submodule_search_locations[0], 'source'))")
B=$(mktemp -d)
flags=(-std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
       -DPK_HAVE_CUTLASS -Icsrc -I. -isystem "$C/include" -isystem "$C/tools/util/include")
t0=$(date +%s)
pids=()
for i in 0 1 2 3 4 5; do  # one translation unit per configuration, in parallel
  nvcc "${flags[@]}" -DPK_SWEEP_INDEX=$i -c tools/gemm_sweep/config.cu -o "$B/config_$i.o" &
  pids+=($!)
done
nvcc "${flags[@]}" -c tools/gemm_sweep/main.cu -o "$B/main.o"
for p in "${pids[@]}"; do wait "$p"; done
nvcc -gencode=arch=compute_90a,code=sm_90a "$B"/*.o -o "$B/gemm_sweep"
echo "gemm_sweep built in $(( $(date +%s) - t0 )) s"
"$B/gemm_sweep" "$@" | tee "$OUT/gemm_sweep.log"
# XLA's dot at the same shapes (the same timing loop as benchmarks/common.py).
python3 - "$@" <<'PY' | tee -a "$OUT/gemm_sweep.log"
import sys
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from common import time_ms
shapes = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [
    (8192, 8192, 8192), (4096, 8192, 8192), (2048, 4096, 4096), (8192, 14336, 8192),
    (8192, 8192, 14336)]
dot = jax.jit(lambda a, b: a @ b)
for m, n, k in shapes:
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    ms = time_ms(lambda: dot(a, b), calls=20)
    print(f"xla {m}x{n}x{k}: {ms:.3f} ms, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s")
PY
