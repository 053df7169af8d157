"""Shared benchmark plumbing: timing, machine description, result files.

Timing is the method the H200 baselines of these machines were measured
with, so ratios are comparable: a jitted function, warm-up, then the median
over batches of host-timed back-to-back calls with block_until_ready at the
end of each batch.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

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
    """The code measured: $PK_BENCH_COMMIT where set (a copy without .git),
    else the checkout's short commit, suffixed "-dirty" when tracked files
    other than the results (which the benchmarks rewrite) differ from it;
    None when neither is known."""
    if os.environ.get("PK_BENCH_COMMIT"):
        return os.environ["PK_BENCH_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True,
                                    check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--",
                    ":(top,exclude)benchmarks/RESULTS.md", ":(top,exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def write_results(op: str, rows: list[dict[str, Any]], table_md: str, command: str) -> None:
    """Write benchmarks/results/<op>.json and replace <op>'s section of RESULTS.md
    (between its begin/end markers; the section names date, machine, commit
    and command)."""
    command = command.strip()
    RESULTS_DIR.mkdir(exist_ok=True)
    date = datetime.date.today().isoformat()
    info = machine()
    code = commit()
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
    if out:  # on the device machine, results travel back through $OUT
        (pathlib.Path(out) / f"{op}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (pathlib.Path(out) / "RESULTS.md").write_text(text)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
