#!/usr/bin/env bash
# The binary of a tile sweep, tools/<name>/, for tools/<name>.sh: prints its path.
# PK_SWEEP_BIN=path: that binary, nothing built. Otherwise config.cu (one
# translation unit per configuration, -DPK_SWEEP_INDEX=i, $(nproc) at a time) and
# main.cu are built into one sm_90a binary; PK_SWEEP_BUILD_ONLY=1 then copies it to
# $PK_SWEEP_OUT_BIN (default ./<name>) and prints nothing. Building needs nvcc and
# the nvidia-cutlass headers (on the GPU machine: after tools/gpu_check.sh, which
# installs them into /tmp/site).
# Usage: tools/sweep_build.sh gemm_sweep|attention_sweep
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1
if [ -n "${PK_SWEEP_BIN:-}" ]; then echo "$PK_SWEEP_BIN"; exit 0; fi
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
if [ -n "${PK_SWEEP_BUILD_ONLY:-}" ]; then cp "$B/$NAME" "${PK_SWEEP_OUT_BIN:-$NAME}"; exit 0; fi
echo "$B/$NAME"
