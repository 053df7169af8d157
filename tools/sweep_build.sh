#!/usr/bin/env bash
# Build a tile sweep, tools/<name>/ (config.cu: one translation unit per
# configuration, -DPK_SWEEP_INDEX=i, $(nproc) at a time; main.cu), into one
# sm_90a binary and print its path. Needs nvcc and the nvidia-cutlass headers (on
# the GPU machine: after tools/gpu_check.sh, which installs them into /tmp/site).
# Usage: tools/sweep_build.sh gemm_sweep|attention_sweep
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1
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
nvcc -gencode=arch=compute_90a,code=sm_90a "$B"/*.o -o "$B/$NAME"
echo "$NAME built in $(( $(date +%s) - t0 )) s" >&2
echo "$B/$NAME"
