"""Where one training step of examples/flax_transformer.py spends its GPU time:
profile one step with jax.profiler, parse the trace it writes, and print a
table per op category (attention forward / backward kernels, GEMMs, FP8
quantization kernels, pk_jax's communication kernels and copies, XLA's
collectives, other) with each category's GPU time and its exposed
communication; optionally a timeline picture (SVG, written by hand: no
plotting package needed).

    python tools/step_breakdown.py --preset gpu --sp 1 --tp 1 --collectives both \\
        [--svg step.svg] [--save]
    python tools/step_breakdown.py --preset gpu_llama --sp 1 --tp 1 --collectives pk \
        --fp8 none,current,block   # the pk step without and with FP8 projections
    python tools/step_breakdown.py --trace path/to/host.trace.json.gz   # a trace already taken

`--collectives`: "pk", "xla" (the example's baseline: XLA's collectives,
cuDNN attention or the cuDNN ring where cuDNN takes the shapes) or "both".
Each run compiles, trains two warm-up steps, then one profiled step (inputs
already on the devices). `--save` writes the "step_breakdown" section of
benchmarks/RESULTS.md and benchmarks/results/step_breakdown.json.

Method. jax.profiler writes plugins/profile/<run>/<host>.trace.json.gz (the
Chrome trace format; no tensorboard plugin needed to read it). GPUs: the
events of the "Stream #..." lines of each "/device:GPU:<n>" process (kernels
and memcpys from CUPTI, each with the XLA op that issued it in args.hlo_op).
CPUs (fake devices): the XLA op events of the host threads, by
args.device_ordinal (control-flow ops that only contain others are left out).
Each event gets one category from its kernel name and XLA op:
  * pk communication: memcpys (copy engines) and signal / gather kernels that
    a pk_jax op issued; XLA collectives: NCCL kernels and the ops
    all-gather, reduce-scatter, all-reduce, collective-permute, ...; these two
    are the communication;
  * attention fwd / bwd: pk_jax's ring attention and block backward kernels,
    cuDNN's flash fprop / bprop kernels; GEMM: cuBLAS / CUTLASS / pk_jax GEMM
    kernels and dot ops; FP8 quantize: pk_jax's quantization kernels (also
    where a TP op's custom call runs them); copies: other device memcpys;
    other: the rest.
Per device: "GPU time" of a category is the time at least one of its events
runs (overlap between streams counted once); "exposed" is the time its
events run while no computation (any non-communication category) runs on the
same device. Communication inside a fused kernel (pk_jax's ring attention
forward pushing K/V from communicator CTAs, the NVLink epilogue stores of
matmul_reduce_scatter) is part of that kernel's computation here: the
profile cannot split it. Numbers are the mean over the devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import html
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (category, is communication, colour in the picture), in table order.
CATEGORIES = (
    ("attention fwd", False, "#1f77b4"),
    ("attention bwd", False, "#6baed6"),
    ("GEMM", False, "#2ca02c"),
    ("FP8 quantize", False, "#bcbd22"),
    ("pk communication", True, "#d62728"),
    ("XLA collectives", True, "#ff7f0e"),
    ("copies", False, "#9467bd"),
    ("other", False, "#8c8c8c"),
)
COMM = frozenset(name for name, comm, _ in CATEGORIES if comm)
COLOURS = {name: colour for name, _, colour in CATEGORIES}

_COLLECTIVE_OP = re.compile(r"^(all[-_]gather|all[-_]reduce|reduce[-_]scatter|collective[-_]permute|"
                            r"ppermute|all[-_]to[-_]all|psum|send|recv|collective[-_]broadcast|"
                            r"ragged[-_]all[-_]to[-_]all)")
_PK_KERNEL = re.compile(r"pk::|\b2pk\d")  # demangled or mangled pk_jax namespace
_PK_COMM_KERNEL = re.compile(r"all_gather|signals|wait_credit|post_kernel|wait_posted|"
                             r"finish_kernel|stamp_kernel|sum_slots")
_ATTN_BWD = re.compile(r"attention_bwd|BwdKernel|init_dq|bprop|dgrad|fmha.*bwd|flash.*bwd",
                       re.I)
_ATTN_FWD = re.compile(r"ring_attention|AttentionKernel|fprop|sdpa|fmha|flash", re.I)
_ATTN_BWD_OP = re.compile(r"(attention|fmha|sdpa).*(bwd|backward)", re.I)
_ATTN_FWD_OP = re.compile(r"attention|fmha|sdpa", re.I)
_GEMM = re.compile(r"gemm|nvjet|xmma|matmul|cublas|wgmma|tensorop", re.I)
_GEMM_OP = re.compile(r"^(dot|dot_general|[\w-]*gemm|[\w-]*matmul|cublas)", re.I)
_QUANTIZE = re.compile(r"fp8.*(tile_kernel|amax_kernel)")  # pk_jax's quantization kernels
_HOST_COPY = re.compile(r"H2D|D2H|HtoD|DtoH|H2H", re.I)
_CONTROL_FLOW_OP = re.compile(r"^(while|conditional|call|async|end: )")


def classify(name: str, op: str = "") -> str:
    """The category of one device event: `name` is the kernel (or memcpy)
    name, `op` the XLA op that issued it ("" when unknown)."""
    pk = op.startswith("pk_") or bool(_PK_KERNEL.search(name))
    if re.match(r"(?i)memcpy|memset", name):
        if _HOST_COPY.search(name):
            return "other"
        if _COLLECTIVE_OP.match(op):
            return "XLA collectives"
        if pk or "P2P" in name or op.startswith("custom-call"):
            return "pk communication"
        return "copies"
    if "nccl" in name.lower() or _COLLECTIVE_OP.match(op):
        return "XLA collectives"
    if pk and "device_kernel" not in name and _PK_COMM_KERNEL.search(name):
        return "pk communication"  # (a CUTLASS kernel's template arguments may name anything)
    if pk and _QUANTIZE.search(name):
        return "FP8 quantize"
    if _ATTN_BWD.search(name) or _ATTN_BWD_OP.search(op):
        return "attention bwd"
    if _ATTN_FWD.search(name) or _ATTN_FWD_OP.search(op):
        return "attention fwd"
    if _GEMM.search(name) or _GEMM_OP.match(op):
        return "GEMM"
    return "other"


# ---- the trace -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Event:
    """One device event, times in microseconds."""

    device: str
    lane: str  # the stream (GPUs) or host thread (CPUs) it ran on
    start: float
    end: float
    name: str
    op: str
    category: str


def find_trace(log_dir: str | os.PathLike) -> pathlib.Path:
    """The newest <host>.trace.json.gz that jax.profiler wrote under `log_dir`."""
    found = glob.glob(os.path.join(str(log_dir), "plugins", "profile", "*", "*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}: did "
                                "jax.profiler.trace write there?")
    return pathlib.Path(max(found, key=os.path.getmtime))


def device_events(trace: dict) -> dict[str, list[Event]]:
    """The device events of a Chrome-format trace (the dict of a
    trace.json.gz), by device: GPU stream events where the trace has GPUs,
    else the XLA op events of CPU devices."""
    procs, threads = {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    gpus = {pid: m.group(1) for pid, name in procs.items()
            if (m := re.search(r"/device:GPU:(\d+)", name))}
    out: dict[str, list[Event]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        end = start + max(float(e.get("dur", 0.0)), 0.0)
        if gpus:
            lane = threads.get((e["pid"], e.get("tid")), "")
            if e["pid"] not in gpus or not lane.startswith("Stream"):
                continue
            device, name, op = f"GPU {gpus[e['pid']]}", e.get("name", ""), str(args.get("hlo_op", ""))
        else:
            op = str(args.get("hlo_op", ""))
            if not op or "device_ordinal" not in args or _CONTROL_FLOW_OP.match(op):
                continue
            device, name = f"CPU {args['device_ordinal']}", op
            lane = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        out.setdefault(device, []).append(Event(device, lane, start, end, name, op,
                                                classify(name, op)))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split()[1])))


# ---- interval arithmetic ----------------------------------------------------------
def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the given (start, end) pairs."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def measure(disjoint) -> float:
    return sum(e - s for s, e in disjoint)


def subtract(a, b) -> list[tuple[float, float]]:
    """The parts of disjoint sorted intervals `a` not covered by disjoint sorted `b`."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# ---- the breakdown -----------------------------------------------------------------
def device_breakdown(events: list[Event]) -> dict:
    """One device's numbers (ms): span (first event start to last end), busy
    (any event running), and per category: events, time, exposed (comm only)."""
    spans = {c: union((e.start, e.end) for e in events if e.category == c) for c, _, _ in CATEGORIES}
    compute = union(iv for c, ivs in spans.items() if c not in COMM for iv in ivs)
    comm = union(iv for c in COMM for iv in spans[c])
    ms = lambda us: us / 1e3
    return {
        "span_ms": ms(max(e.end for e in events) - min(e.start for e in events)),
        "busy_ms": ms(measure(union((e.start, e.end) for e in events))),
        "comm_ms": ms(measure(comm)),
        "exposed_comm_ms": ms(measure(subtract(comm, compute))),
        "categories": {c: {"events": sum(e.category == c for e in events),
                           "ms": ms(measure(spans[c])),
                           "exposed_ms": ms(measure(subtract(spans[c], compute)))
                           if c in COMM else None}
                       for c, _, _ in CATEGORIES},
    }


def breakdown(by_device: dict[str, list[Event]]) -> dict:
    """The mean over devices of `device_breakdown`, and each device's span."""
    per = {d: device_breakdown(ev) for d, ev in by_device.items() if ev}
    if not per:
        raise ValueError("the trace has no device events (on GPUs: is CUPTI available to "
                         "jax.profiler?)")
    mean = lambda f: sum(f(b) for b in per.values()) / len(per)
    out = {k: mean(lambda b, k=k: b[k]) for k in ("span_ms", "busy_ms", "comm_ms",
                                                  "exposed_comm_ms")}
    out["devices"] = {d: b["span_ms"] for d, b in per.items()}
    out["categories"] = {
        c: {"events": mean(lambda b, c=c: b["categories"][c]["events"]),
            "ms": mean(lambda b, c=c: b["categories"][c]["ms"]),
            "exposed_ms": mean(lambda b, c=c: b["categories"][c]["exposed_ms"])
            if c in COMM else None}
        for c, _, _ in CATEGORIES}
    return out


def rows(run: str, b: dict) -> list[dict]:
    """JSON rows of one run's breakdown: one per category, then the totals."""
    out = [dict(run=run, category=c, events=v["events"], gpu_ms=v["ms"],
                share=v["ms"] / b["span_ms"] if b["span_ms"] else 0.0,
                communication=c in COMM, exposed_ms=v["exposed_ms"])
           for c, v in b["categories"].items()]
    out.append(dict(run=run, category="step", span_ms=b["span_ms"], busy_ms=b["busy_ms"],
                    comm_ms=b["comm_ms"], exposed_comm_ms=b["exposed_comm_ms"],
                    devices=b["devices"]))
    return out


def markdown(runs: dict[str, dict]) -> str:
    """One table over the runs: a row per category with time, then the step."""
    lines = ["| run | category | events | GPU time (ms) | % of step | exposed (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for run, b in runs.items():
        for c, v in b["categories"].items():
            if not v["events"]:
                continue
            share = 100 * v["ms"] / b["span_ms"] if b["span_ms"] else 0.0
            exposed = f"{v['exposed_ms']:.2f}" if c in COMM else ""
            lines.append(f"| {run} | {c} | {v['events']:g} | {v['ms']:.2f} | {share:.1f}% | "
                         f"{exposed} |")
        lines.append(f"| {run} | **step** (busy {b['busy_ms']:.2f}, communication "
                     f"{b['comm_ms']:.2f}) | | {b['span_ms']:.2f} | 100% | "
                     f"{b['exposed_comm_ms']:.2f} |")
    return "\n".join(lines)


def _short(e: Event) -> str:
    """An event's label: its XLA op without the instance number, and the
    kernel (memcpy) name up to its template / argument list where it differs."""
    kernel = re.split(r"[<(]", e.name.removeprefix("void "), maxsplit=1)[0][:60]
    op = re.sub(r"\.\d+$", "", e.op)
    return kernel if not op else op if e.name == e.op else f"{op} / {kernel}"


def top_ops(by_device: dict[str, list[Event]], n: int = 10) -> list[tuple[str, str, float, float]]:
    """The `n` ops with the most event time (summed, mean over devices):
    (category, label, ms, events)."""
    total: dict[tuple[str, str], list[float]] = {}
    for events in by_device.values():
        for e in events:
            t = total.setdefault((e.category, _short(e)), [0.0, 0])
            t[0] += (e.end - e.start) / 1e3
            t[1] += 1
    k = max(len(by_device), 1)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [(c, label, ms / k, count / k) for (c, label), (ms, count) in ranked]


def top_markdown(runs: dict[str, dict[str, list[Event]]], n: int = 10) -> str:
    lines = ["| run | op (XLA op or kernel) | category | events | time (ms, summed) |",
             "| --- | --- | --- | --- | --- |"]
    for run, by_device in runs.items():
        lines += [f"| {run} | `{label.replace('|', '/')}` | {c} | {count:g} | {ms:.2f} |"
                  for c, label, ms, count in top_ops(by_device, n)]
    return "\n".join(lines)


# ---- the picture ---------------------------------------------------------------------
def write_svg(path: str | os.PathLike, runs: dict[str, dict[str, list[Event]]],
              width: int = 1400, lane_h: int = 14, max_devices: int = 4) -> None:
    """A timeline: per run and device, one row per stream (thread), each
    event a rectangle coloured by category; time from the device's first event."""
    label_w, y, body = 170, 30, []
    spans = [max(e.end for e in ev) - min(e.start for e in ev)
             for by in runs.values() for ev in list(by.values())[:max_devices] if ev]
    scale = (width - label_w - 10) / max(max(spans, default=1.0), 1e-9)
    for run, by_device in runs.items():
        body.append(f'<text x="4" y="{y + 11}" font-weight="bold">{html.escape(run)}</text>')
        y += lane_h + 2
        for device, events in list(by_device.items())[:max_devices]:
            if not events:
                continue
            t0 = min(e.start for e in events)
            for lane in sorted({e.lane for e in events}):
                body.append(f'<text x="4" y="{y + 11}">{html.escape(device)} '
                            f'{html.escape(lane[:18])}</text>')
                for e in events:
                    if e.lane != lane:
                        continue
                    x, w = label_w + (e.start - t0) * scale, max((e.end - e.start) * scale, 0.5)
                    body.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 2}" '
                                f'fill="{COLOURS[e.category]}"><title>{html.escape(e.category)}: '
                                f'{html.escape(e.op or e.name)[:200]} '
                                f'{(e.end - e.start) / 1e3:.3f} ms</title></rect>')
                y += lane_h
        y += lane_h
    legend = "".join(f'<rect x="{label_w + 150 * i}" y="6" width="12" height="12" fill="{col}"/>'
                     f'<text x="{label_w + 150 * i + 16}" y="16">{html.escape(c)}</text>'
                     for i, (c, _, col) in enumerate(CATEGORIES))
    scale_ms = max(max(spans, default=0.0) / 1e3, 0.0)
    legend += f'<text x="4" y="16">0 - {scale_ms:.2f} ms</text>'
    pathlib.Path(path).write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
        f'font-family="sans-serif" font-size="10">{legend}{"".join(body)}</svg>\n')


# ---- profiling the example ---------------------------------------------------------------
def load_example():
    """examples/flax_transformer.py as a module (examples/ is not a package)."""
    path = ROOT / "examples" / "flax_transformer.py"
    spec = importlib.util.spec_from_file_location("flax_transformer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def profile_step(example, collectives: str, cfg, mesh, log_dir: str, warmup: int = 2,
                 attention=None, fp8: str = "none") -> tuple[str, pathlib.Path]:
    """Compile the example's step for `collectives` (and the projections'
    FP8 recipe `fp8`, one of the example's FP8 names; "pk" only), train
    `warmup` steps, then profile one into `log_dir`; (the run's name, its
    trace file)."""
    import jax

    with jax.set_mesh(mesh):
        if collectives == "xla" and attention is None:
            attention = example.baseline_attention(cfg, mesh)
        trainer = example.build(collectives, cfg, mesh, attention, fp8=fp8)
        print(trainer.description, flush=True)
        data = example.batches(cfg)
        for _ in range(warmup):
            jax.block_until_ready(trainer.step(*trainer.put(*next(data))))
        batch = jax.block_until_ready(trainer.put(*next(data)))
        with jax.profiler.trace(log_dir):
            jax.block_until_ready(trainer.step(*batch))
    name = "pk" if collectives == "pk" else attention.name
    return (name if fp8 == "none" else f"{name} fp8 {fp8}"), find_trace(log_dir)


def read_trace(path: str | os.PathLike) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None,
                        help="parse this trace.json(.gz) instead of profiling the example")
    parser.add_argument("--collectives", choices=("pk", "xla", "both"), default="both")
    parser.add_argument("--fp8", default="none",
                        help="the pk run's FP8 recipes, comma-separated (the example's --fp8 "
                             "names): one pk run each, e.g. none,current,block")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    parser.add_argument("--trace-dir", default=None,
                        help="where jax.profiler writes (default: a temporary directory)")
    parser.add_argument("--top", type=int, default=10, help="list the N ops with most time")
    parser.add_argument("--svg", default=None, help="write a timeline picture here")
    parser.add_argument("--save", action="store_true",
                        help="write the step_breakdown section of benchmarks/RESULTS.md")
    args, rest = parser.parse_known_args(argv)
    if args.trace:
        traces = {pathlib.Path(args.trace).name: device_events(read_trace(args.trace))}
        description, setting = f"trace {args.trace}", {}
    else:
        example = load_example()
        model = argparse.ArgumentParser(prog="step_breakdown.py (model options)")
        example.add_model_arguments(model)
        cfg, mesh = example.model_from_arguments(model.parse_args(rest), model)
        recipes = args.fp8.split(",")
        if unknown := [r for r in recipes if r not in example.FP8]:
            parser.error(f"--fp8 {args.fp8}: unknown {unknown}, expected names of {example.FP8}")
        if args.collectives == "xla" and recipes != ["none"]:
            parser.error("--fp8 applies to the pk run: --collectives pk or both")
        runs = [("pk", r) for r in recipes] if args.collectives != "xla" else []
        runs += [("xla", "none")] if args.collectives != "pk" else []
        attention = example.baseline_attention(cfg, mesh) if args.collectives != "pk" else None
        traces = {}
        for c, fp8 in runs:
            label = c if fp8 == "none" else f"{c}_fp8_{fp8}"
            log_dir = (os.path.join(args.trace_dir, label) if args.trace_dir
                       else tempfile.mkdtemp(prefix=f"step_breakdown_{label}_"))
            name, path = profile_step(example, c, cfg, mesh, log_dir, args.warmup, attention, fp8)
            print(f"{name}: trace {path}", flush=True)
            traces[name] = device_events(read_trace(path))
            platform = mesh.devices.flat[0].platform
            if platform == "gpu" and not any(d.startswith("GPU") for d in traces[name]):
                raise SystemExit(f"{path} has no GPU events: jax.profiler recorded no kernels "
                                 "(is CUPTI available, e.g. the nvidia-cuda-cupti package?)")
        description = (f"One training step of examples/flax_transformer.py (d_model "
                       f"{cfg.d_model}, {cfg.num_layers} layers, heads {cfg.num_heads}/"
                       f"{cfg.num_kv_heads} x {cfg.head_dim}, hidden {cfg.hidden}, batch "
                       f"{cfg.batch} x {cfg.seq_len} tokens, {cfg.dtype}, mesh sp="
                       f"{mesh.shape['sp']} x tp={mesh.shape['tp']}) after {args.warmup} "
                       f"warm-up steps")
        if attention is not None:
            description += f"; baseline `{attention.name}`: XLA's collectives, {attention.note}"
        setting = dict(config=dataclasses.asdict(cfg), sp=mesh.shape["sp"], tp=mesh.shape["tp"],
                       warmup=args.warmup)
    results = {run: breakdown(ev) for run, ev in traces.items()}
    table = markdown(results) + "\n\nThe ops with the most time (mean over devices):\n\n" + \
        top_markdown(traces, args.top)
    print(table)
    if args.svg:
        write_svg(args.svg, traces)
        print(f"timeline: {args.svg}")
    if args.save:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from common import write_results
        text = (f"{description}. Profiled with jax.profiler and parsed by tools/step_breakdown.py "
                f"(its docstring: categories, and how exposed communication is measured). "
                f"Times are the mean over devices; GPU time counts overlapping events of a "
                f"category once; exposed: communication running while no computation runs "
                f"on the device.\n\n{table}")
        write_results("step_breakdown",
                      [dict(r, **setting) for run, b in results.items() for r in rows(run, b)],
                      text, "python tools/step_breakdown.py " + " ".join(
                          sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
