#!/usr/bin/env bash
# One command on a GPU machine: build + install, GPU and CPU tests, benchmarks,
# and a short summary last. Usage: tools/gpu_check.sh [pytest args...]
set -uo pipefail
# NVLink multicast must stay off on shared hosts (NCCL, NVSHMEM, PyTorch).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pk_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5

echo "== build"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 || exit 1
echo "build: $(( $(date +%s) - t0 )) s"

echo "== tests"
python3 -m pytest -q -rs tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
test_rc=${PIPESTATUS[0]}

echo "== benchmarks"
for b in benchmarks/all_gather.py; do
  (cd benchmarks && python3 "$(basename "$b")") 2>&1 | tee "$OUT/$(basename "$b" .py).log" | tail -3
done

echo "== summary"
grep -E "passed|failed" "$OUT/pytest.log" | tail -1
python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
from all_gather import HEADER, table_row
rows = json.load(open(os.path.join(os.environ.get("OUT", "/tmp/pk_out"), "all_gather.json")))
print("all_gather (" + ", ".join(HEADER) + ")")
for r in rows:
    print("  ".join(f"{c:>10}" for c in table_row(r)))
PY
exit $test_rc
