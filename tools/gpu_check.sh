#!/usr/bin/env bash
# One command on a GPU machine: build + install, GPU and CPU tests, benchmarks,
# and a short summary last. Usage: tools/gpu_check.sh [pytest args...]
# PK_GPU_STAGES picks what runs after the build (default: all, ~40 min on 2 GPUs;
# a few stages at a time keep each run short; "none" only builds):
#   tests  pytest -v on the given args (default: the whole tests/ directory, ~25 min
#          on 2 GPUs: the ring attention GPU file alone is ~120 tests of ~7 s, so
#          pass a file and -k for a shorter run), one line per test in $OUT/pytest.log
#   bwd    ring attention's end-to-end backward GPU tests, then fwd+bwd rows
#   bench  all_gather and tp_matmul benchmarks
#   ring   ring attention forward (16k-64k), mechanisms copy_engine and ld_st
#   flax   the Flax example's step time (GPU preset), pk against xla
#   mp     two processes (one GPU each, or sharing one GPU): the runtime's IPC check
#          (tests/native/ipc_pair_check.cu) and every op across processes
#          (tests/scripts/gpu_multiprocess_check.py), ~2-4 min
#   gemm   (not in the default list) the GEMM's tile configurations and swizzles
#          on one GPU against XLA's dot, ~3-4 min (tools/sweep.sh gemm_sweep)
# Logs land in $OUT (results JSON and RESULTS.md too: benchmarks/common.py), so a run
# cut short keeps what it did.
set -uo pipefail
# NVLink multicast must stay off on shared hosts (NCCL, NVSHMEM, PyTorch).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5

# Build-time packages the GPU image lacks (nvidia-cutlass) travel as wheels in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# PK_GPU_WHEEL=path installs a wheel built elsewhere (PK_JAX_BUILD_CUDA=1 pip wheel) in
# place of the build, with nvcc and the CUDA toolkit's folders taken off PATH, and
# runs Python with -P so that this checkout's pk_jax/ cannot shadow the installed one.
PY=(python3)
if [ -n "${PK_GPU_WHEEL:-}" ]; then
  echo "== install $PK_GPU_WHEEL (no CUDA toolkit on PATH)"
  PATH=$(tr : '\n' <<< "$PATH" | grep -v -i cuda | paste -sd: -); export PATH
  if command -v nvcc > /dev/null; then echo "nvcc still on PATH: $(command -v nvcc)"; exit 1; fi
  python3 -m pip install -q --no-deps --force-reinstall "$PK_GPU_WHEEL" 2>&1 | tail -3
  PY=(python3 -P)
  (cd /tmp && python3 -c "import pk_jax, pk_jax._build_info as b; from pk_jax import runtime; \
print(pk_jax.__file__, {k: v for k, v in vars(b).items() if not k.startswith('_')}, \
'kernels:', runtime.available() and runtime.extension().has_gemm)") || exit 1
else
  echo "== build"
  t0=$(date +%s)
  python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 || exit 1
  echo "build: $(( $(date +%s) - t0 )) s"
fi

STAGES=${PK_GPU_STAGES:-tests mp bwd bench ring flax}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
test_rc=0
# Each test is cut at 120 s where pytest-timeout is installed (the GPU image has it).
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)

if stage tests; then
  echo "== tests"
  "${PY[@]}" -m pytest -v -rs "${per_test[@]}" "${@:-tests}" > "$OUT/pytest.log" 2>&1
  test_rc=$?
  grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -20
  tail -3 "$OUT/pytest.log"
fi

if stage mp; then
  echo "== two processes"
  gpus=$(nvidia-smi -L | wc -l)
  pair="0 0"; [ "$gpus" -ge 2 ] && pair="0 1"
  nvcc -std=c++17 -O1 -gencode=arch=compute_90a,code=sm_90a -I csrc -I . \
    tests/native/ipc_pair_check.cu csrc/runtime/*.cc \
    -o /tmp/ipc_pair_check -lcuda > "$OUT/ipc_pair_check.log" 2>&1 \
    && timeout 120 /tmp/ipc_pair_check $pair >> "$OUT/ipc_pair_check.log" 2>&1
  echo "ipc_pair_check ($pair): rc=$?"; tail -3 "$OUT/ipc_pair_check.log"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 "${PY[@]}" -m pk_jax.launch -n 2 \
    --gpus-per-process 0 tests/scripts/gpu_multiprocess_check.py > "$OUT/multiprocess.log" 2>&1
  mp_rc=$?
  [ $mp_rc -ne 0 ] && test_rc=$mp_rc
  grep -E "^\[.\] (OK|FAILED)|Error|DONE" "$OUT/multiprocess.log" | tail -40
fi

if stage bwd; then
  echo "== ring attention backward: end-to-end GPU tests, then fwd+bwd benchmark rows"
  # The block-level tests (~40, ~15 s each) do not fit here: run them with the tests stage.
  timeout 240 "${PY[@]}" -m pytest -v -rs "${per_test[@]}" tests/test_attention_bwd_gpu.py \
    -k "ring_attention_grads or in_scan or training or deterministic" \
    > "$OUT/pytest_bwd.log" 2>&1
  bwd_rc=$?
  [ $bwd_rc -ne 0 ] && test_rc=$bwd_rc
  grep -E "FAILED|ERROR" "$OUT/pytest_bwd.log" | head -20
  tail -2 "$OUT/pytest_bwd.log"
  (cd benchmarks && timeout 240 python3 ring_attention.py \
    --seqs 16384,32768 --backward --ws1-seq 8192) 2>&1 | tee "$OUT/ring_attention_bwd.log" \
    | grep -E "^(!!!!|--|total)" | tail -12
fi

if stage bench; then
  echo "== benchmarks"
  for b in benchmarks/all_gather.py benchmarks/tp_matmul.py; do
    (cd benchmarks && python3 "$(basename "$b")") 2>&1 | tee "$OUT/$(basename "$b" .py).log" | tail -3
  done
fi

# Ring attention forward, ~2.5 min on 2 GPUs (mostly compiles); results are saved
# after every group, so a timeout keeps what was measured.
if stage ring; then
  echo "== ring attention (pk against the cuDNN ring, the einsum ring and the one-GPU ideal)"
  (cd benchmarks && timeout 330 python3 ring_attention.py --seqs 16384,32768,65536 \
    --mechanisms copy_engine,ld_st) 2>&1 \
    | tee "$OUT/ring_attention.log" | grep -E "^(!!!!|--|total)" | tail -12
fi

if stage flax; then
  echo "== flax example (step time, pk against xla)"
  # The GPU preset (bf16, head dim 128, 8k tokens) on every GPU; results go to RESULTS.md.
  timeout 400 python3 examples/flax_transformer.py --preset gpu \
    --steps 20 --collectives both --save 2>&1 | tee "$OUT/flax.log" | tail -3
fi

if stage gemm; then
  echo "== gemm tile sweep (one GPU)"
  timeout 400 tools/sweep.sh gemm_sweep 2>&1 | grep -E "^(best|xla|gemm_sweep built|\| [0-9].*WRONG)"
fi

echo "== summary"
for log in pytest pytest_bwd; do
  [ -f "$OUT/$log.log" ] && echo "$log: $(grep -E "passed|failed" "$OUT/$log.log" | tail -1)"
done
python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
from all_gather import HEADER, table_row
path = os.path.join(os.environ.get("OUT", "/tmp/pk_out"), "all_gather.json")
if os.path.exists(path):
    print("all_gather (" + ", ".join(HEADER) + ")")
    for r in json.load(open(path)):
        print("  ".join(f"{c:>10}" for c in table_row(r)))
PY
python3 - <<'PY'
import json, os
path = os.path.join(os.environ.get("OUT", "/tmp/pk_out"), "tp_matmul.json")
if os.path.exists(path):
    print("tp_matmul (op, shape, impl, ms, vs gemm-only, vs xla)")
    for r in json.load(open(path)):
        floor = f"{r['median_ms'] / r['gemm_only_ms']:.3f}" if r["gemm_only_ms"] else "-"
        print(f"{r['op']:>22} {'x'.join(map(str, r['shape'])):>17} {r['implementation']:>9} "
              f"{r['median_ms']:8.3f} {floor:>6} {r['baseline_median_ms'] / r['median_ms']:5.2f}x")
PY
python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
from ring_attention import HEADER, table_row
for op in ("ring_attention", "ring_attention_bwd"):
    path = os.path.join(os.environ.get("OUT", "/tmp/pk_out"), op + ".json")
    if os.path.exists(path):
        print(op + " (" + ", ".join(HEADER) + ")")
        for r in json.load(open(path)):
            print("  ".join(f"{c:>8}" for c in table_row(r)))
PY
exit $test_rc
