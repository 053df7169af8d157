"""Shared benchmark plumbing: timing, machine description, result files.

Timing is the method the H200 baselines of these machines were measured
with, so ratios are comparable: a jitted function, warm-up, then the median
over batches of host-timed back-to-back calls with block_until_ready at the
end of each batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pk_jax import PkJaxFallbackWarning

# A pk row must time pk's kernels: a fallback to the XLA reference path (a
# kernel missing, the runtime's workspace not allocated) stops the run
# instead of timing XLA under pk's name.
warnings.filterwarnings("error", category=PkJaxFallbackWarning)

HERE = pathlib.Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"


def time_ms(fn: Callable[[], Any], *, calls: int = 10, batches: int = 5, warmup: int = 3) -> float:
    """Median milliseconds per call of `fn` (which returns jax arrays)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(per_call)


def interleaved_ms(fns: dict[str, Callable[[], Any]], *, rounds: int = 3, calls: int = 10,
                   batches: int = 3,
                   on_round: Callable[[int, dict[str, float]], None] | None = None
                   ) -> dict[str, list[float]]:
    """time_ms of each of `fns` in turn, `rounds` times, so that clock drift
    under sustained load moves them alike: each one's per-round times.
    Each round starts `len(fns) // rounds` (at least 1) further down the
    list, so no implementation is first in more than one round where
    `rounds` <= len(fns): the first of a round ran up to 8% off the same
    code later in it, mostly faster (one H200, kernels_attention
    2026-12-06, the `pk` rows against their twins), and the median over
    rounds drops that round.
    `on_round(r, {name: ms})` after every round (progress lines)."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    step = max(1, len(names) // max(rounds, 1))
    for r in range(rounds):
        start = (r * step) % len(names) if names else 0
        for name in names[start:] + names[:start]:
            runs[name].append(time_ms(fns[name], calls=calls, batches=batches))
        if on_round is not None:
            on_round(r, {name: t[-1] for name, t in runs.items()})
    return runs


def cuda_profiler(start: bool) -> None:
    """cudaProfilerStart / Stop (through CuPy) around the region Nsight
    Compute profiles with --profile-from-start off; best effort."""
    try:
        import cupy
        (cupy.cuda.runtime.profilerStart if start else cupy.cuda.runtime.profilerStop)()
    except Exception as e:  # noqa: BLE001 - best effort: timing still runs
        print(f"profiler {'start' if start else 'stop'} unavailable: {e}")


def one_axis_mesh(devices, name: str = "x") -> Mesh:
    """A 1-D mesh over `devices` (the benchmarks' layout)."""
    return Mesh(np.array(devices), (name,), axis_types=(AxisType.Auto,))


def bench_setup(name: str = "x") -> tuple[list, Mesh, np.random.Generator]:
    """Every visible device, a one-axis mesh over them, and a fresh generator
    (fresh random inputs every run)."""
    devices = jax.devices()
    return devices, one_axis_mesh(devices, name), np.random.default_rng()


def machine() -> dict[str, Any]:
    devs = jax.devices()
    return {"gpu_model": devs[0].device_kind, "gpu_count": len(devs),
            "platform": devs[0].platform, "jax": jax.__version__}


def commit() -> str | None:
    """The code measured: $PK_BENCH_COMMIT where set; else, where the pk_jax
    imported is an installed build and not this checkout's sources (a wheel),
    the commit its build recorded (pk_jax._build_info.commit; None where it
    recorded none); else the checkout's short commit, suffixed "-dirty" when
    tracked files other than the results (which the benchmarks rewrite)
    differ from it; None when neither is known."""
    if os.environ.get("PK_BENCH_COMMIT"):
        return os.environ["PK_BENCH_COMMIT"]
    import pk_jax
    if not pathlib.Path(pk_jax.__file__).resolve().is_relative_to(HERE.parent):
        try:
            from pk_jax import _build_info
        except ImportError:
            return None
        return getattr(_build_info, "commit", "") or None
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True,
                                    check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--",
                    ":(top,exclude)benchmarks/RESULTS.md", ":(top,exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def write_results(op: str, rows: list[dict[str, Any]], table_md: str, command: str,
                  measured: dict[str, Any] | None = None) -> None:
    """Write benchmarks/results/<op>.json and replace <op>'s section of RESULTS.md
    (between its begin/end markers; the section names date, machine, commit
    and command). `measured`: {"machine": machine(), "commit": commit()} of
    the process that timed the rows, where another writes them (kernels.py
    --merge); else this process's."""
    command = command.strip()
    RESULTS_DIR.mkdir(exist_ok=True)
    date = datetime.date.today().isoformat()
    info = measured["machine"] if measured else machine()
    code = measured["commit"] if measured else commit()
    for r in rows:
        r.setdefault("op", op)
        r.update(date=date, commit=code, **info)
    (RESULTS_DIR / f"{op}.json").write_text(json.dumps(rows, indent=1) + "\n")
    section = (f"<!-- {op}:begin -->\n## {op}\n\n{date}, {info['gpu_count']} x {info['gpu_model']}, "
               f"jax {info['jax']}, commit {code or 'not recorded'}. Command: `{command}`\n\n"
               f"{table_md}\n<!-- {op}:end -->")
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n"
    begin, end = f"<!-- {op}:begin -->", f"<!-- {op}:end -->"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    RESULTS_MD.write_text(text)
    out = os.environ.get("OUT")
    if out:  # tools/gpu_check.sh collects its outputs in $OUT
        (pathlib.Path(out) / f"{op}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (pathlib.Path(out) / "RESULTS.md").write_text(text)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# --- collective benchmarks (all_gather.py, all_reduce.py) --------------------

COLLECTIVE_HEADER = ["per rank", "impl", "ms/call", "bus GB/s", "vs xla", "us/call in program",
                     "vs xla"]
UNROLL = 10  # dependent calls per loop iteration: amortizes the loop's own cost


def parse_size(s: str) -> int:
    """"8K" / "1M" / "2G" / "4096" -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def collective_row(name: str, shape: list[int], per_rank: int, bus_bytes: float,
                   bw_ms: dict, lat_us: dict) -> dict:
    """One implementation at one size (bf16), as written to results/<op>.json;
    `bus_bytes` is what the op's convention counts as carried per call."""
    return {"shape": shape, "dtype": "bfloat16", "per_rank_bytes": per_rank,
            "implementation": name, "median_ms": bw_ms[name], "baseline": "xla",
            "baseline_median_ms": bw_ms["xla"],
            "bus_GBps": bus_bytes / (bw_ms[name] * 1e-3) / 1e9,
            "loop_latency_us": lat_us.get(name), "baseline_loop_latency_us": lat_us.get("xla")}


def collective_table_row(r: dict) -> list:
    """A collective_row as a COLLECTIVE_HEADER table row (ratios are xla / ours)."""
    ratio = lambda base, ours: "-" if r["implementation"] == "no_comm" or ours is None \
        else f"{base / ours:.2f}x"
    lat = r["loop_latency_us"]
    return [f"{r['per_rank_bytes'] >> 10} KiB", r["implementation"], f"{r['median_ms']:.4f}",
            "-" if r["implementation"] == "no_comm" else f"{r['bus_GBps']:.1f}",
            ratio(r["baseline_median_ms"], r["median_ms"]),
            "-" if lat is None else f"{lat:.1f}",
            ratio(r["baseline_loop_latency_us"], lat)]


def bandwidth_fn(mesh: Mesh, op: Callable) -> Callable:
    """One jitted call of the per-shard `op` over the mesh's axis "x"."""
    return jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def latency_fn(mesh: Mesh, step: Callable, calls: int) -> Callable:
    """`calls` dependent calls in one program: a fori_loop whose body runs
    UNROLL `step`s (one op call each, shaped so its result feeds the next)."""
    def body(i, c):
        for _ in range(UNROLL):
            c = step(c)
        return c
    return jax.jit(jax.shard_map(lambda c: lax.fori_loop(0, calls // UNROLL, body, c),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def time_collective(mesh: Mesh, impls: dict[str, Callable], step: Callable, x, *,
                    loop: int, latency: bool, smoke: bool = False) -> tuple[dict, dict]:
    """Per implementation: host-timed ms per jitted call (bandwidth) and, where
    `latency`, us per call inside a `loop`-call program whose body is
    step(op, c). `smoke`: the fewest calls (checks the script runs)."""
    bw_ms, lat_us = {}, {}
    timing = dict(calls=2, batches=2, warmup=1) if smoke else {}
    for name, op in impls.items():
        f = bandwidth_fn(mesh, op)
        bw_ms[name] = time_ms(lambda: f(x), **timing)
        if latency:
            g = latency_fn(mesh, lambda c, op=op: step(op, c), loop)
            lat_us[name] = time_ms(lambda: g(x), calls=1 if smoke else 3,
                                   batches=1 if smoke else 3) * 1e3 / loop
    return bw_ms, lat_us


def bf16_input(mesh: Mesh, rng: np.random.Generator, elems: int):
    """Fresh random bf16 [n * elems], sharded along "x"."""
    n = mesh.devices.size
    return jax.device_put(jnp.asarray(rng.standard_normal(n * elems, dtype=np.float32),
                                      jnp.bfloat16), NamedSharding(mesh, P("x")))


def collective_args(default_sizes: str,
                    extra: Callable[[argparse.ArgumentParser], None] | None = None
                    ) -> argparse.Namespace:
    """The collective benchmarks' command line (--sizes, --loop, --latency-max,
    --smoke, and what `extra` adds), parsed; --smoke sets two tiny sizes and
    a short loop."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=default_sizes)
    ap.add_argument("--loop", type=int, default=200, help="calls in the latency program")
    ap.add_argument("--latency-max", default="16M", help="largest size timed in the loop")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, few calls, nothing written (checks the script runs)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.loop = "8K,1M", 20
    return args


def size_inputs(args: argparse.Namespace, mesh: Mesh, rng: np.random.Generator):
    """Per --sizes entry: (per-rank bytes, bf16 elements per rank, a fresh
    random input [n * elements] sharded along "x")."""
    for per_rank in map(parse_size, args.sizes.split(",")):
        yield per_rank, per_rank // 2, bf16_input(mesh, rng, per_rank // 2)


def finish_collective(op: str, rows: list[dict], md: str, smoke: bool) -> None:
    """Write the results (or, under --smoke, say that nothing was written)."""
    if smoke:
        print("SMOKE_OK (nothing written)")
    else:
        write_results(op, rows, md, f"python benchmarks/{op}.py " + " ".join(sys.argv[1:]))
        print(md)
