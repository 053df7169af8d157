"""Where one layer's FP8 training step spends its GPU time: the kernels of each
implementation of benchmarks/kernels.py's fp8_train section (pk_jax.fp8_dot's
recipes, XLA's bf16 and FP8 dots, Flax's FP8 ops) at one shape, from a
jax.profiler trace, beside the step's wall time.

    python tools/fp8_step_profile.py [--shape 8192,5120,13824] [--impls a,b,...]
        [--calls 5] [--json out.json]

Per implementation: the wall time of a call (median of `--calls` calls, each
waited for), the GPU time of its kernels (the union of their intervals, per
call) and the gap between the two (the GPU idle inside a step: launches,
host work, waits); then its kernels, grouped by name, with their time per
call. The kernel names are CUPTI's (cuBLAS's name its tile and cluster; a
CUTLASS kernel shows as cutlass::device_kernel with its XLA op).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))


def kernel_table(events, calls: int) -> list[tuple[str, str, float, float]]:
    """(kernel name, XLA op, ms per call, launches per call), most time first."""
    total: dict[tuple[str, str], list[float]] = {}
    for e in events:
        t = total.setdefault((e.name[:110], e.op), [0.0, 0])
        t[0] += (e.end - e.start) / 1e3
        t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])
    return [(name, op, ms / calls, n / calls) for (name, op), (ms, n) in ranked]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192,5120,13824", help="M,K,N")
    ap.add_argument("--impls", default="pk_fp8_delayed,pk_fp8_current,pk_fp8fast_current,"
                    "pk_fp8_block,pk_cutlass_fp8_current,pk_tp_fp8_current,xla_bf16,flax_fp8_xla",
                    help="comma-separated fp8_train implementations")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", default="", help="write the tables here")
    args = ap.parse_args(argv)

    import jax

    import kernels
    import step_breakdown as sb

    m, k, n = map(int, args.shape.split(","))
    x, w, dy = kernels.fp8_train_inputs(m, k, n)
    wanted = args.impls.split(",")
    # Flax's FP8 layers only when asked for (compiling them takes minutes a shape)
    steps = kernels.fp8_train_steps(x, w, dy, flax=any(i.startswith("flax") for i in wanted))
    unknown = [i for i in wanted if i not in steps]
    if unknown:
        ap.error(f"--impls: unknown {unknown}; choose from {sorted(steps)}")
    report = {}
    for name in wanted:
        step = steps[name]
        for _ in range(3):
            jax.block_until_ready(step(x, w, dy))
        wall = []
        for _ in range(max(args.calls, 3)):
            t0 = time.perf_counter()
            jax.block_until_ready(step(x, w, dy))
            wall.append((time.perf_counter() - t0) * 1e3)
        with tempfile.TemporaryDirectory() as log_dir:
            with jax.profiler.trace(log_dir):
                for _ in range(args.calls):
                    jax.block_until_ready(step(x, w, dy))
            by_device = sb.device_events(sb.read_trace(sb.find_trace(log_dir)))
        events = [e for evs in by_device.values() for e in evs]
        busy = sb.measure(sb.union((e.start, e.end) for e in events)) / 1e3 / args.calls
        rows = kernel_table(events, args.calls)
        report[name] = {"wall_ms": statistics.median(wall), "gpu_busy_ms": busy,
                        "kernels": [dict(zip(("name", "op", "ms", "launches"), r))
                                    for r in rows]}
        print(f"== {name} {m}x{k}x{n}: wall {statistics.median(wall):.3f} ms a call, "
              f"kernels busy {busy:.3f} ms", flush=True)
        for kname, op, ms, launches in rows:
            print(f"   {ms:7.3f} ms  x{launches:g}  {op:28.28}  {kname}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
