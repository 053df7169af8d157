#!/usr/bin/env bash
# A tile sweep on one GPU: tools/<name>/'s binary times its kernel configurations
# at its shapes (every output checked first), then tools/sweep_baseline.py times
# what a user runs without pk_jax at the same shapes in the same call, to pick the
# kernels' tiles per shape class:
#   gemm_sweep       the sm90 GEMMs' tiles and swizzles, bf16 and FP8, against XLA's
#                    dot (cuBLAS); shapes M,N,K
#   attention_sweep  the fused ring attention forward's key tiles, K/V stages and
#                    mainloop variants (head dims 64, 128, 256), bf16, against
#                    cuDNN's fused attention; shapes B,S,HQ,HKV,D,CAUSAL
# Usage: tools/sweep.sh NAME [SHAPE ...] (no shapes: the binary's table); output in
# $OUT/NAME.log. The binary: PK_SWEEP_BIN=path runs one built earlier; otherwise
# config.cu (one translation unit per configuration, -DPK_SWEEP_INDEX=i, $(nproc) at
# a time) and main.cu are built, which needs nvcc and the nvidia-cutlass headers (on
# the GPU machine: after tools/gpu_check.sh, which installs them into /tmp/site);
# PK_SWEEP_BUILD_ONLY=1 copies the build to $PK_SWEEP_OUT_BIN (default ./NAME) and
# stops. PK_SWEEP_CONFIGS=i,j,... runs only those configurations (their indices
# in config.cu's list, from 0), e.g. to profile one kernel under Nsight Compute.
# gemm_sweep: PK_SWEEP_SWIZZLES=8,1 times only those tile swizzles, in that order.
# A shape's configurations run in index order, each 3 + 20 launches after its check:
# the later ones meet a GPU nearer its power limit, at a lower clock (NOTES.md,
# 2026-12-07: a three-run index-order sweep had the plain causal form ahead of the lazy
# one at s16384, six runs alternating PK_SWEEP_CONFIGS=0 and =2 put the lazy one ahead
# at every shape). For an A/B, run each configuration alone, alternating which goes first.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1; shift
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
BIN=${PK_SWEEP_BIN:-}
if [ -z "$BIN" ]; then
  C=$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); \
print(os.path.join(s.submodule_search_locations[0], 'source'))")
  B=$(mktemp -d)
  flags=(-std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
         -DPK_HAVE_CUTLASS -Icsrc -I. -isystem "$C/include" -isystem "$C/tools/util/include"
         -isystem "$C/examples/88_hopper_fmha")
  t0=$(date +%s)
  configs=$(grep -c '^    Entry<' "tools/$NAME/config.cu")  # one configuration a line
  seq 0 $((configs - 1)) | xargs -P "$(nproc)" -I{} \
    nvcc "${flags[@]}" -DPK_SWEEP_INDEX={} -c "tools/$NAME/config.cu" -o "$B/config_{}.o"
  nvcc "${flags[@]}" -c "tools/$NAME/main.cu" -o "$B/main.o"
  BIN="$B/$NAME"
  nvcc -gencode=arch=compute_90a,code=sm_90a "$B"/*.o -o "$BIN"
  echo "$NAME built in $(( $(date +%s) - t0 )) s"
  if [ -n "${PK_SWEEP_BUILD_ONLY:-}" ]; then cp "$BIN" "${PK_SWEEP_OUT_BIN:-$NAME}"; exit 0; fi
fi
"$BIN" "$@" | tee "$OUT/$NAME.log"
# The binary's first line names the shapes it ran.
read -r -a shapes <<< "$(sed -n 's/^shapes //p' "$OUT/$NAME.log" | head -1)"
python3 tools/sweep_baseline.py "$NAME" "${shapes[@]}" | tee -a "$OUT/$NAME.log"
