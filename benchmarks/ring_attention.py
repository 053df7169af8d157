"""Ring attention (sequence parallel over every visible GPU, mesh axis "sp"):
pk_jax.ring_attention against baselines measured in the same run.

Implementations, bf16, global sequence S split over n = device count:
  * pk: `pk_jax.ring_attention` inside shard_map (`--mechanism`, default
    "auto"; or `--mechanisms copy_engine,ld_st,ld_st:8` to time several in one
    run, rows pk_<layout>_<mechanism>, "ld_st:C" forcing C communicator CTAs,
    row suffix ld_stC). Non-causal: layout "contiguous"; causal: layout
    "zigzag" (inputs reordered with `pk_jax.zigzag_shard` before sharding) and
    "contiguous".
  * cudnn_ring: the Transformer Engine approach (baselines/cudnn_ring.py,
    whose docstring has the recipe): a ppermute ring inside shard_map
    running cuDNN flash attention on each visiting K/V block, merged with the
    log-sum-exp; causal zigzag and contiguous; its backward (`--backward`) a
    second ring of cuDNN backward calls fed the global output and
    log-sum-exp.
  * einsum_ring: a ppermute ring with plain einsum + fp32 softmax, i.e.
    `pk_jax.ring_attention(..., mechanism="xla")` (forward only, up to
    `--einsum-max-seq`: it materializes S_local^2 scores per head).
  * ideal: cuDNN on one GPU with the same per-GPU work and no communication
    (non-causal: S/n queries against S keys; causal: the whole-sequence
    causal call's time divided by n).
  * world size 1: pk on a 1-GPU mesh against one-GPU cuDNN (`--ws1-seq`).

Per-GPU TFLOP/s: non-causal forward 4*B*(S/n)*S*Hq*D; causal counts only
the unmasked half; forward+backward counts 3.5x the forward (the backward as
2.5x, the convention the cuDNN baselines on these machines were measured with).

Correctness guard before any timing: every output is checked on sampled query
rows against an fp32 reference of the whole sequence, and pk's output against
the cuDNN ring's on the same inputs (whole output); with `--backward` the
gradients of a weighted sum of the output are checked against one-GPU
attention on the whole sequence. An implementation outside bf16 tolerance is
marked FAILED and not timed: the speed of a wrong answer is not reported.

cuDNN blocks are probed at start-up on small cases against an fp32 einsum
(baselines/cudnn_ring.py): a mismatch skips the cuDNN rows, or only the
backward ring, with the reason. Without CUDA GPUs the cuDNN and ideal rows
are skipped with a printed reason; `--emulate-cudnn` puts fp32 einsum blocks
in cuDNN's place to check the ring logic on CPU.

Usage:
  python benchmarks/ring_attention.py [--seqs 16384,32768,65536] [--backward]
  CPU smoke test:  python benchmarks/ring_attention.py --cpu-devices 8 \\
      --seqs 256 --heads 2 --ws1-seq 128 --no-save [--emulate-cudnn] [--backward]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _channels, tuning
from pk_jax.ops.ring_attention import bwd_primitive as ring_attention_bwd_primitive
from pk_jax.ops.ring_attention.primitive import region_bytes
from baselines.cudnn_ring import (F32, HI, NEG, TOL_GRAD_L2, TOL_L2, Blocks, RingSpec,
                                  Unavailable, cudnn_blocks, cudnn_ring, einsum_blocks,
                                  first_line, grouped_scores)
from common import markdown_table, one_axis_mesh, time_ms, write_results

AXIS = "sp"
SEQ = P(None, AXIS)
# bf16 tolerances: relative L2 error of the whole compared tensor (TOL_L2,
# TOL_GRAD_L2, shared with the cuDNN probe), and the worst single row (token)
# relative error. bf16 rounding alone gives ~0.3%.
TOL_ROW, TOL_GRAD_ROW = 5e-2, 1e-1
BWD_FLOP_FACTOR = 3.5  # forward + backward, backward counted as 2.5x forward

HEADER = ["n", "S", "mask", "pass", "impl", "ms", "TFLOP/s/GPU", "of ideal", "vs cuDNN ring"]


@dataclasses.dataclass(frozen=True)
class Dims:
    """Problem dimensions other than the sequence."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


# ---- helpers -------------------------------------------------------------------
@jax.jit
def _errors_jit(a, b):
    a, b = a.astype(F32), b.astype(F32)
    d = a - b
    l2 = jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
    axes = tuple(range(2, a.ndim))
    row_ref = jnp.sqrt(jnp.sum(b * b, axis=axes))
    # rows far below the typical norm (e.g. dq of token 0 under a causal mask,
    # exactly 0) are measured against the mean row norm instead
    row = jnp.sqrt(jnp.sum(d * d, axis=axes)) / jnp.maximum(
        jnp.maximum(row_ref, jnp.mean(row_ref)), 1e-30)
    finite = jnp.all(jnp.isfinite(a))
    return jnp.where(finite, l2, jnp.inf), jnp.where(finite, jnp.max(row), jnp.inf)


def _errors(a, b) -> tuple[float, float]:
    """(relative L2 error of a against b, worst per-token relative error);
    inf when a has a NaN or inf. Rows are the sequence axis (axis 1)."""
    if getattr(b, "sharding", None) != getattr(a, "sharding", None):
        b = jax.device_put(b, a.sharding)
    l2, row = _errors_jit(a, b)
    return float(l2), float(row)


def _flops(dims: Dims, s: int, n: int, causal: bool, backward: bool) -> float:
    """Per-GPU FLOPs of one call (causal: unmasked work only)."""
    f = 4.0 * dims.batch * (s / n) * s * dims.heads * dims.head_dim
    return f * (0.5 if causal else 1.0) * (BWD_FLOP_FACTOR if backward else 1.0)


def _timed(fn: Callable[[], Any]) -> float:
    """Median ms per call; `fn` was already compiled and run by the guard.
    Batches of ~0.1 s (2 to 10 calls) keep long sequences affordable."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    once = time.perf_counter() - t0
    calls = int(min(10, max(2, 0.1 / max(once, 1e-6))))
    return time_ms(fn, calls=calls, batches=5, warmup=1)


def _random(key, shape, dtype, sharding):
    return jax.jit(lambda k: jax.random.normal(k, shape, F32).astype(dtype),
                   out_shardings=sharding)(key)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _reference_rows(q, k, v, rows, causal: bool, scale: float):
    """fp32 attention of the natural-order query rows `rows` against the whole
    sequence: [B, R, Hq, D]."""
    qr = jnp.take(q, rows, axis=1)
    _, s, _ = grouped_scores(qr, k, False, scale)
    if causal:
        s = jnp.where(rows[:, None] >= jnp.arange(k.shape[1])[None, :], s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    b, r, hq, d = qr.shape
    return jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32), precision=HI).reshape(b, r, hq, d)


def _sample_rows(s: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Natural positions to check: both ends of every zigzag chunk, an even
    spread, and a few random ones."""
    c = s // (2 * n)
    ends = [x for i in range(2 * n) for x in (i * c, (i + 1) * c - 1)]
    rows = np.concatenate([ends, np.linspace(0, s - 1, 32).astype(int), rng.integers(0, s, 16)])
    return np.unique(np.clip(rows, 0, s - 1)).astype(np.int32)


# ---- one (sequence, mask) group of rows -----------------------------------------
class Group:
    """Runs the implementations of one (n, S, mask, pass) and records rows."""

    def __init__(self, bench: "Bench", n: int, s: int, causal: bool, backward: bool):
        self.b, self.n, self.s, self.causal, self.backward = bench, n, s, causal, backward
        self.times: dict[str, float] = {}
        self.status: dict[str, tuple[str, str]] = {}  # name -> (status, reason)
        self.layouts: dict[str, str] = {}
        self.mechanisms: dict[str, str] = {}  # pk rows: the mechanism (":C" for forced CTAs)

    def fail(self, name: str, status: str, reason: str) -> None:
        self.status[name] = (status, reason)
        loud = "!!!!" if status == "FAILED" else "--"
        print(f"{loud} n={self.n} S={self.s} {'causal' if self.causal else 'non-causal'} "
              f"{'fwd+bwd' if self.backward else 'fwd'} {name}: {status}: {reason}", flush=True)

    def time(self, name: str, layout: str, fn: Callable[[], Any], divide: int = 1) -> None:
        """Time fn unless the guard already failed or skipped `name`."""
        self.layouts[name] = layout
        if name in self.status:
            return
        try:
            self.times[name] = _timed(fn) / divide
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            self.fail(name, "error", first_line(e))

    def rows(self) -> list[dict[str, Any]]:
        """Result rows (JSON) with ratios against this group's baselines."""
        d, n, s = self.b.dims, self.n, self.s
        flops = _flops(d, s, n, self.causal, self.backward)
        ideal = self.times.get("ideal") or self.times.get("cudnn")
        rings = {k: v for k, v in self.times.items() if k.startswith("cudnn_ring")}
        best = min(rings.values()) if rings else self.times.get("cudnn")
        out = []
        for name in dict.fromkeys([*self.layouts, *self.status]):
            ms = self.times.get(name)
            status, reason = self.status.get(name, ("ok", ""))
            same = rings.get("cudnn_ring_" + self.layouts.get(name, ""))
            out.append({
                "op": "ring_attention", "gpus": n, "seq": s, "mask": "causal" if self.causal
                else "none", "pass": "fwd+bwd" if self.backward else "fwd",
                "implementation": name, "layout": self.layouts.get(name), "status": status,
                "reason": reason, "batch": d.batch, "heads": d.heads, "kv_heads": d.kv_heads,
                "head_dim": d.head_dim, "dtype": jnp.dtype(d.dtype).name,
                "mechanism": self.mechanisms.get(name),
                "median_ms": ms, "tflops_per_gpu": flops / (ms * 1e-3) / 1e12 if ms else None,
                "ideal_ms": ideal, "baseline": "best cudnn_ring" if n > 1 else "cudnn",
                "baseline_median_ms": best, "cudnn_ring_same_layout_ms": same,
                "of_ideal": ideal / ms if ms and ideal else None,
                "vs_baseline": best / ms if ms and best else None,
                "vs_cudnn_ring_same_layout": same / ms if ms and same else None})
        return out


def table_row(r: dict[str, Any]) -> list[Any]:
    """One JSON row as a RESULTS.md table row."""
    fmt = lambda x, f: "-" if x is None else format(x, f)
    ms = r["median_ms"]
    impl = r["implementation"] if r["status"] == "ok" else f"{r['implementation']} **{r['status']}**"
    tf = r["tflops_per_gpu"]
    return [r["gpus"], r["seq"], r["mask"], r["pass"], impl, fmt(ms, ".3f"),
            fmt(tf, ".0f" if tf is None or tf >= 10 else ".2g"), fmt(r["of_ideal"], ".1%"),
            "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x"]


class Bench:
    """Inputs, meshes and implementations; one run of the benchmark."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dims = Dims(args.batch, args.heads, args.kv_heads or args.heads, args.head_dim)
        self.devices = jax.devices()
        self.rng = np.random.default_rng()
        self.blocks: Blocks | None = None
        self.skip_reason = ""
        if args.emulate_cudnn:
            self.blocks = einsum_blocks()
        else:
            try:
                self.blocks = cudnn_blocks()
            except Unavailable as e:
                self.skip_reason = str(e)
        if self.blocks is None:
            print(f"-- cuDNN rows (cudnn_ring, ideal, world-size-1 cudnn) skipped: "
                  f"{self.skip_reason}", flush=True)
        else:
            print(f"-- block attention: {self.blocks.name} ({self.blocks.note})", flush=True)
            if args.backward and self.blocks.bwd is None:
                print(f"-- cuDNN ring backward skipped: {self.blocks.bwd_note}", flush=True)

    # inputs --------------------------------------------------------------
    def inputs(self, mesh, s: int, seed: int):
        """Natural-order q, k, v, w (output weights for the loss), sharded on
        the sequence over `mesh`."""
        d = self.dims
        sh = NamedSharding(mesh, SEQ)
        keys = jax.random.split(jax.random.key(seed), 4)
        q = _random(keys[0], (d.batch, s, d.heads, d.head_dim), d.dtype, sh)
        k = _random(keys[1], (d.batch, s, d.kv_heads, d.head_dim), d.dtype, sh)
        v = _random(keys[2], (d.batch, s, d.kv_heads, d.head_dim), d.dtype, sh)
        w = _random(keys[3], (d.batch, s, d.heads, d.head_dim), d.dtype, sh)
        return q, k, v, w

    # implementations -----------------------------------------------------
    def sharded(self, mesh, per_device: Callable, check_vma: bool = True) -> Callable:
        """Global (q, k, v) -> output, or -> (loss, grads) with --backward."""
        f = jax.shard_map(per_device, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ,
                          check_vma=check_vma)
        if not self.args.backward:
            return jax.jit(f)
        loss = lambda q, k, v, w: jnp.sum(f(q, k, v).astype(F32) * w.astype(F32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def pk(self, mesh, causal: bool, layout: str, mechanism: str) -> Callable:
        """`mechanism` is "<mechanism>[:C]": C communicator CTAs (ld_st)."""
        mechanism, _, ctas = mechanism.partition(":")
        kw = dict(num_comm_ctas=int(ctas)) if ctas else {}
        return self.sharded(mesh, lambda q, k, v: pk_jax.ring_attention(
            q, k, v, AXIS, causal=causal, scale=self.dims.scale, layout=layout,
            mechanism=mechanism, **kw))

    def pk_rows(self, n: int, layout: str) -> list[tuple[str, str]]:
        """(row name, mechanism) of the pk rows: one row named pk_<layout>
        (n = 1: pk) for --mechanism, or pk_<layout>_<mechanism> for each of
        --mechanisms."""
        base = f"pk_{layout}" if n > 1 else "pk"
        if not self.args.mechanisms:
            return [(base, self.args.mechanism)]
        return [(f"{base}_{m.replace(':', '')}", m)
                for m in self.args.mechanisms.split(",")]

    def ring(self, mesh, causal: bool, layout: str) -> Callable:
        spec = RingSpec(mesh.size, causal, layout, self.dims.scale, AXIS)
        return self.sharded(mesh, cudnn_ring(spec, self.blocks), check_vma=False)

    def one_gpu(self, causal: bool, reference: bool = False) -> Callable:
        """Attention of the whole given sequence on one device (cuDNN; for
        `reference` without cuDNN here: XLA's attention)."""
        whole = self.blocks.whole if self.blocks is not None else einsum_blocks().whole
        assert reference or self.blocks is not None
        f = lambda q, k, v: whole(q, k, v, causal, self.dims.scale)
        if not self.args.backward:
            return jax.jit(f)
        loss = lambda q, k, v, w: jnp.sum(f(q, k, v).astype(F32) * w.astype(F32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    # one group ------------------------------------------------------------
    def run_group(self, n: int, s: int, causal: bool) -> Group:
        args, dims = self.args, self.dims
        backward = args.backward
        g = Group(self, n, s, causal, backward)
        mesh = one_axis_mesh(self.devices[:n], AXIS)
        seed = int(self.rng.integers(1 << 31))
        q, k, v, w = self.inputs(mesh, s, seed)
        dev0 = self.devices[0]
        whole1 = [jax.device_put(x, dev0) for x in (q, k, v, w)]  # natural order, one GPU
        layouts = ["zigzag", "contiguous"] if causal and n > 1 else ["contiguous"]
        zig = lambda x: jax.jit(functools.partial(pk_jax.zigzag_shard, axis_size=n),
                                out_shardings=x.sharding)(x)
        by_layout = {"contiguous": (q, k, v, w)}
        if "zigzag" in layouts:
            by_layout["zigzag"] = tuple(zig(x) for x in (q, k, v, w))
        order = {"contiguous": np.arange(s)}
        if "zigzag" in layouts:
            z = np.asarray(pk_jax.zigzag_shard(jnp.arange(s), n, seq_axis=0))
            order["zigzag"] = np.argsort(z)  # natural position -> index in zigzag order
        rows = _sample_rows(s, n, self.rng)
        ref_rows = None if backward else np.asarray(
            _reference_rows(*whole1[:3], jnp.asarray(rows), causal, dims.scale))
        ref_grads = None
        if backward:  # gradients of the whole sequence on one device: the backward reference
            try:
                _, ref_grads = self.one_gpu(causal, reference=True)(*whole1)
            except Exception as e:  # noqa: BLE001
                print(f"-- gradient reference failed ({first_line(e)}); only pk against the "
                      f"cuDNN ring is compared", flush=True)

        # candidates: name -> (layout, compiled fn, its inputs)
        cands: dict[str, tuple[str, Callable, tuple]] = {}
        for lay in layouts:
            ins = by_layout[lay][: 4 if backward else 3]
            for name, mech in self.pk_rows(n, lay):
                cands[name] = (lay, self.pk(mesh, causal, lay, mech), ins)
                g.mechanisms[name] = mech
            if n == 1:
                if self.blocks is not None:
                    cands["cudnn"] = (lay, self.one_gpu(causal), tuple(whole1[: 4 if backward
                                                                           else 3]))
                continue
            if self.blocks is None:
                g.fail(f"cudnn_ring_{lay}", "skipped", self.skip_reason)
            elif backward and self.blocks.bwd is None:
                g.fail(f"cudnn_ring_{lay}", "skipped", self.blocks.bwd_note)
            else:
                cands[f"cudnn_ring_{lay}"] = (lay, self.ring(mesh, causal, lay), ins)
        if n > 1 and not backward:
            lay = layouts[0]
            if s <= args.einsum_max_seq:
                cands["einsum_ring"] = (lay, self.pk(mesh, causal, lay, "xla"), by_layout[lay][:3])
            else:
                g.fail("einsum_ring", "skipped", f"S > --einsum-max-seq {args.einsum_max_seq}")

        # correctness guard: run every candidate once, check, then time the good ones
        results, checked = {}, set()
        for name, (lay, fn, ins) in cands.items():
            g.layouts[name] = lay
            try:
                results[name] = jax.block_until_ready(fn(*ins))
            except Exception as e:  # noqa: BLE001
                g.fail(name, "error", first_line(e))
                if args.verbose:
                    traceback.print_exc()
                continue
            if backward:
                if ref_grads is None:
                    continue
                grads = results[name][1]
                if lay == "zigzag":
                    want = [zig(jax.device_put(r, grads[0].sharding)) for r in ref_grads]
                else:
                    want = ref_grads
                errs = [_errors(a, b) for a, b in zip(grads, want)]
                bad = [(nm, e) for nm, e in zip("qkv", errs)
                       if not (e[0] <= TOL_GRAD_L2 and e[1] <= TOL_GRAD_ROW)]
                checked.add(name)
                if bad:
                    g.fail(name, "FAILED", "gradients differ from one-GPU attention: " + ", ".join(
                        f"d{nm} rel {e[0]:.3g} worst token {e[1]:.3g}" for nm, e in bad)
                        + f" (seed {seed})")
            else:
                got = np.asarray(jnp.take(results[name], jnp.asarray(order[lay][rows]), axis=1))
                l2, row = _errors(jnp.asarray(got), jnp.asarray(ref_rows))
                checked.add(name)
                if not (l2 <= TOL_L2 and row <= TOL_ROW):
                    g.fail(name, "FAILED", f"output differs from fp32 attention on {len(rows)} "
                           f"sampled rows: rel {l2:.3g}, worst row {row:.3g} (seed {seed})")
        pk_pairs = [(pk_name, "cudnn" if n == 1 else f"cudnn_ring_{lay}")
                    for lay in layouts for pk_name, _ in self.pk_rows(n, lay)]
        for pk_name, ring_name in pk_pairs:  # pk against the cuDNN ring, same inputs, whole output
            if pk_name in results and ring_name in results and not any(
                    g.status.get(x, ("",))[0] == "FAILED" for x in (pk_name, ring_name)):
                checked.update((pk_name, ring_name))
                a, b = results[pk_name], results[ring_name]
                pairs = zip(a[1], b[1]) if backward else [(a, b)]
                tol = (TOL_GRAD_L2, TOL_GRAD_ROW) if backward else (TOL_L2, TOL_ROW)
                for x, y in pairs:
                    l2, row = _errors(x, y)
                    if not (l2 <= tol[0] and row <= tol[1]):
                        g.fail(pk_name, "FAILED", f"differs from the cuDNN ring: rel {l2:.3g}, "
                               f"worst token {row:.3g} (seed {seed})")
                        break
        del results
        for name in cands:
            if name not in checked and name not in g.status:
                g.fail(name, "unchecked", "no reference could be computed; not timed")

        for name, (lay, fn, ins) in cands.items():
            g.time(name, lay, lambda fn=fn, ins=ins: fn(*ins))
        if self.blocks is None:
            g.fail("ideal" if n > 1 else "cudnn", "skipped", self.skip_reason)
        elif n > 1:
            one = self.one_gpu(causal)
            if causal:  # whole-sequence causal on one GPU, divided by n
                g.time("ideal", "one GPU", lambda: one(*whole1[: 4 if backward else 3]), divide=n)
            else:  # S/n queries against all S keys
                part = [x[:, : s // n] for x in (whole1[0], whole1[3])]
                ins = (part[0], whole1[1], whole1[2]) + ((part[1],) if backward else ())
                g.time("ideal", "one GPU", lambda: one(*ins))
        return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768,65536", help="global sequence lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mechanism", default="auto", help="pk_jax.ring_attention mechanism")
    ap.add_argument("--mechanisms", default="",
                    help="time several pk mechanisms, comma-separated, each "
                    "<mechanism>[:C] (e.g. copy_engine,ld_st,ld_st:8; ld_st:C forces C "
                    "communicator CTAs); rows pk_<layout>_<mechanism>; overrides --mechanism")
    ap.add_argument("--bwd-transport", choices=("pk", "xla"), default=None,
                    help="the backward's transport for the kernel mechanisms (default: "
                    "pk_jax/tuning.py): pk (one fused call) or xla (collective-permutes "
                    "between block kernels)")
    ap.add_argument("--backward", action="store_true",
                    help="time value_and_grad of a weighted sum of the output instead")
    ap.add_argument("--masks", default="none,causal", help="subset of none,causal")
    ap.add_argument("--einsum-max-seq", type=int, default=32768,
                    help="largest S of the einsum ring (it stores S_local^2 fp32 scores)")
    ap.add_argument("--ws1-seq", type=int, default=8192,
                    help="sequence of the world-size-1 rows (0: none)")
    ap.add_argument("--emulate-cudnn", action="store_true",
                    help="fp32 einsum blocks in place of cuDNN (checks the ring logic on CPU)")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="run on this many fake CPU devices (smoke test)")
    ap.add_argument("--no-save", action="store_true",
                    help="print only; leave results/ and RESULTS.md alone")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failing rows")
    args = ap.parse_args()
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cpu_devices}")
        jax.config.update("jax_platforms", "cpu")
    if args.bwd_transport:
        tuning.RING_ATTENTION_BWD_TRANSPORT = args.bwd_transport
    t_start = time.perf_counter()
    bench = Bench(args)
    n = len(bench.devices)
    _size_workspace(bench, n)
    masks = [m.strip() for m in args.masks.split(",")]
    print(f"ring_attention: {n} x {bench.devices[0].device_kind}, {bench.dims}, "
          f"mechanism={args.mechanisms or args.mechanism}, "
          f"{'fwd+bwd' if args.backward else 'fwd'}"
          f"{f' (bwd transport {tuning.RING_ATTENTION_BWD_TRANSPORT})' if args.backward else ''}",
          flush=True)
    rows: list[dict[str, Any]] = []
    plan = [(n, int(s), m == "causal") for s in args.seqs.split(",") for m in masks]
    if args.ws1_seq:
        plan += [(1, args.ws1_seq, m == "causal") for m in masks]
    for gn, s, causal in plan:
        if gn > 1 and s % (2 * gn):
            print(f"-- S={s} skipped: must divide by 2n = {2 * gn}", flush=True)
            continue
        t0 = time.perf_counter()
        new = bench.run_group(gn, s, causal).rows()
        rows += new
        print(markdown_table(HEADER, [table_row(r) for r in new]), flush=True)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        md = _markdown(bench, rows)
        if not args.no_save:  # after every group: a run cut short keeps what it measured
            # Forward+backward runs keep their own section and JSON.
            write_results("ring_attention_bwd" if args.backward else "ring_attention", rows, md,
                          "python benchmarks/ring_attention.py " + " ".join(sys.argv[1:]))
    print(_markdown(bench, rows))
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    pk_jax.check_errors()
    failed = [r for r in rows if r["status"] == "FAILED"]
    if failed:
        print(f"!!!! {len(failed)} FAILED rows: " + ", ".join(
            f"S={r['seq']} {r['mask']} {r['implementation']}" for r in failed), flush=True)
        return 1
    return 0


def _size_workspace(bench: Bench, n: int) -> None:
    """Every (mechanism, K/V size) keeps its own staging region for the life
    of the process (pk_jax/runtime.py: regions are never reused across
    channels), so a sweep over sizes and mechanisms needs their sum; the
    default 1 GiB holds one 64k problem, not the whole sweep."""
    d, args = bench.dims, bench.args
    kinds = max(1, len((args.mechanisms or args.mechanism).split(",")))
    need = sum(region_bytes(n, (d.batch, int(s) // n, d.kv_heads, d.head_dim))
               for s in args.seqs.split(",")) * kinds
    if args.backward and n > 1:  # the fused backward's regions (one channel, by size class)
        need += sum({_channels.size_class(ring_attention_bwd_primitive.region_bytes(
            n, (d.batch, int(s) // n, d.kv_heads, d.head_dim))) for s in args.seqs.split(",")})
    if need + (64 << 20) > pk_jax.get_config().workspace_bytes:
        pk_jax.configure(workspace_bytes=need + (64 << 20))


def _markdown(bench: Bench, rows: list[dict[str, Any]]) -> str:
    """The RESULTS.md section body: explanation and table."""
    args = bench.args
    md = (f"b{bench.dims.batch} h{bench.dims.heads} kv{bench.dims.kv_heads} d{bench.dims.head_dim} "
          f"bf16, sequence parallel over n GPUs (1-D mesh \"sp\"), pk mechanism "
          f"`{args.mechanisms or args.mechanism}`. Columns: time per call (ms); per-GPU "
          f"TFLOP/s (causal: unmasked "
          f"work only; fwd+bwd: 3.5x the forward); fraction of the no-communication ideal "
          f"(one-GPU cuDNN with the same per-GPU work); speedup over the best cuDNN ring of "
          f"the same mask (Transformer Engine's approach; n=1: over one-GPU cuDNN). "
          f"Causal impls are suffixed with their layout. Every output was checked against an "
          f"fp32 reference (and pk against the cuDNN ring) before timing; FAILED rows are "
          f"not timed.\n\n" + markdown_table(HEADER, [table_row(r) for r in rows]))
    if bench.blocks is not None:
        md += f"\n\nBlock attention: {bench.blocks.note}."
    return md


if __name__ == "__main__":
    raise SystemExit(main())
