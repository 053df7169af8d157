"""One GPU: the compute kernels inside pk_jax's fused ops against the kernels
a user runs without pk_jax, in the same run, in interleaved rounds (clock
drift under sustained load moves every implementation alike).

Sections (--only):
  attention  pk's ring_attention at world size 1 ("pk": what `auto` runs there,
             pk_jax/tuning.py's measured choice; "pk_kernel": pk's own fused
             kernel, mechanism="copy_engine", where it takes the shapes;
             "pk_kernel_cudnn_bwd": that kernel's forward with cuDNN's
             backward, tuning.forced's third alternative) against
             cuDNN (jax.nn.dot_product_attention(implementation="cudnn")) and
             tokamax 0.0.17 (implementation="mosaic", Mosaic GPU; "triton"
             where it runs): forward, and forward + backward (value_and_grad).
             TFLOP/s count 4 B S^2 H D (x0.5 causal, x3.5 forward + backward).
  gemm       pk's CUTLASS GEMM (all_gather_matmul at world size 1; forward, and
             forward + backward: y, then dx and dw in one call) against XLA's
             dot (cuBLAS).
  fp8        pk's scaled FP8 GEMM (pk_jax.fp8_matmul: e4m3 per-tensor factors,
             and 1x128 / 128x128 block factors) against XLA's dot on the same
             FP8 operands with their factors, every way a user writes it
             ("xla_fp8_*": dequantize-then-dot in f32 or bf16, which XLA's
             rewriter maps to cuBLASLt FP8, or the FP8 dot itself; the
             custom calls XLA compiled each to are printed), and XLA's bf16
             dot ("xla_bf16"); the per-tensor GEMM for each operand pair the
             training step runs at the same M, N, K (`role` fprop: e4m3 x e4m3,
             fast accumulation; dgrad: e5m2 x e4m3, dy and w; wgrad: e4m3 x
             e5m2, x^T and dy^T; the gradients promoted to fp32, and
             "pk_fp8_tensor_fast" without promotion: fast_accum=True).
  fp8_train  one layer's training step, y = x @ w then dx and dw, at LLM shapes
             (M x K x N): pk_jax.fp8_dot with each recipe ("pk_fp8_<recipe>":
             quantization and the three FP8 GEMMs; "pk_fp8fast_<recipe>": the
             gradient GEMMs without fp32 promotion; "pk_tp_fp8_<recipe>": the
             same through all_gather_matmul(fp8=) at world size 1) against the bf16 step in
             XLA ("xla_bf16"), XLA's FP8 dot under per-tensor current scaling
             written in jax.numpy ("xla_fp8_current": quantize, dot of the FP8
             operands, the factors after; e5m2 gradients), and Flax's FP8 ops
             (flax.linen.Dense with dot_general_cls=Fp8DotGeneralOp,
             "flax_fp8_xla", and Fp8DirectDotGeneralOp, "flax_fp8_direct",
             where this Flax has it: delayed scaling).
Every pk result is checked against its baseline's before timing (a mismatch
is an error). tokamax is optional (pip install '.[bench]'): without it its
rows are skipped with a message. Results, one file and RESULTS.md section per
section run (each one run's rows): results/kernels_<section>.json (one row per
implementation: op, shape fields, implementation, median_ms, tflops,
best_other, best_other_ms).

Usage: python benchmarks/kernels.py [--only attention,gemm,fp8,fp8_train] [--quick]
       [--match TEXT] [--rounds N] [--smoke] [--skip IMPLS] [--part I/N [--part-out F]]
       python benchmarks/kernels.py --merge F1 F2 ...
(--smoke: tiny shapes; --quick: the first two cases; --match: the cases whose
label holds TEXT, e.g. "d64" or "8192x8192x8192"; these three write nothing;
--skip: attention implementations left out of every row; --part: the I-th of
N slices of a section too long for one sitting, its rows and arguments to a
file; --merge writes the slices' rows as one run's results, naming the first
slice's arguments as the command)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime, tuning
from common import (commit, interleaved_ms, machine, markdown_table, one_axis_mesh,
                    write_results)

SECTIONS = ("attention", "gemm", "fp8", "fp8_train")

# (batch, seq, q heads, kv heads, head dim, causal, dtype)
ATTENTION_CASES = [
    (1, 8192, 16, 16, 128, False, "bfloat16"),
    (1, 8192, 16, 16, 128, True, "bfloat16"),
    (1, 16384, 16, 16, 64, True, "bfloat16"),
    (1, 32768, 8, 8, 128, True, "bfloat16"),
    (1, 8192, 32, 8, 128, True, "bfloat16"),   # GQA, group 4
    (4, 4096, 16, 16, 128, True, "bfloat16"),
    (1, 8192, 16, 16, 128, True, "float16"),
    (1, 8192, 8, 8, 256, True, "bfloat16"),    # head dim 256
    (1, 8192, 8, 8, 256, False, "bfloat16"),
    (1, 16384, 16, 16, 64, False, "bfloat16"),
    (1, 16384, 16, 16, 128, True, "bfloat16"),
    (8, 2048, 16, 16, 128, True, "bfloat16"),  # short sequences
    (16, 1024, 32, 4, 128, False, "bfloat16"),  # GQA, group 8
]
# (M, N, K): 8192^3 and 4096^3, then M = 8192 tokens through the MLP and QKV
# projections of Llama-3 8B (hidden 4096, ffn 14336, qkv 6144) and 70B (8192,
# 28672, 10240), a 70B MLP's per-rank shapes at 8-way TP, DeepSeek-V3's dense
# MLP (7168, 18432), Qwen2.5-72B's (8192, 29568), and fewer / more tokens.
GEMM_SHAPES = [
    (8192, 8192, 8192), (4096, 4096, 4096),
    (8192, 14336, 4096), (8192, 4096, 14336), (8192, 6144, 4096),
    (8192, 28672, 8192), (8192, 8192, 28672), (8192, 10240, 8192),
    (8192, 3584, 8192), (8192, 8192, 3584),
    (8192, 18432, 7168), (8192, 7168, 18432), (8192, 29568, 8192),
    (2048, 14336, 4096), (32768, 4096, 14336),
]
# One layer's training step (M tokens, K in, N out): M from 2048 to 16384 tokens
# through Llama-3 8B's MLP (4096 <-> 14336), 70B's MLP up projection (8192 ->
# 28672), a 13B-class MLP (5120 -> 13824) and 8192^2 at 16k tokens.
FP8_TRAIN_SHAPES = [
    (2048, 4096, 14336), (4096, 8192, 28672), (8192, 4096, 14336), (8192, 14336, 4096),
    (8192, 5120, 13824), (16384, 8192, 8192), (16384, 4096, 14336),
]
FP8_ROLES = {"fprop": ("float8_e4m3fn", "float8_e4m3fn"), "dgrad": ("float8_e5m2", "float8_e4m3fn"),
             "wgrad": ("float8_e4m3fn", "float8_e5m2")}
SMOKE_ATTENTION = [(1, 256, 2, 2, 64, True, "bfloat16")]
SMOKE_FP8_TRAIN = [(256, 256, 256)]
SMOKE_GEMM = [(256, 256, 256)]
HEADER = ["op", "case", "impl", "ms", "TFLOP/s", "best other", "pk vs best other"]
COLUMNS = ("Columns: median ms per call over interleaved rounds, TFLOP/s, the fastest "
           "non-pk implementation of the row's group and pk's speedup over it (above 1: pk "
           "faster).\n\n")
# What each section's implementations are (RESULTS.md, before the columns).
IMPLS = {
    "attention": (
        "`pk`: what `ring_attention(mechanism=\"auto\")` runs on one device "
        "(pk_jax/tuning.py's single_gpu_attention by head dim, mask, sequence length and "
        "GQA group: one of the next three); `pk_kernel`: pk's own fused kernel and its block "
        "backward "
        "(mechanism=\"copy_engine\"; at head dim 256 its backward steps are cuDNN's block "
        "backward); `pk_kernel_cudnn_bwd` (forward + backward only): pk's forward kernel, "
        "then cuDNN's backward fed its output and log-sum-exp; `cudnn`: "
        "jax.nn.dot_product_attention(implementation=\"cudnn\"); `tokamax_*`: tokamax "
        "0.0.17's Mosaic GPU and Triton kernels. TFLOP/s count 4 B S^2 H D (x0.5 causal, "
        "x3.5 forward + backward). `pk` runs the same code as one of `pk_kernel`, "
        "`pk_kernel_cudnn_bwd` and `cudnn`: their spread is the run's noise.\n\n"),
    "gemm": ("`pk`: all_gather_matmul(mechanism=\"chunked\") at world size 1 (pk's CUTLASS "
             "GEMM; forward + backward: y, then dx and dw in one call; under `auto` one "
             "device runs XLA's dot, pk_jax/tuning.py's single_gpu_gemm); `xla`: XLA's dot "
             "(cuBLAS).\n\n"),
    "fp8": (
        "`pk_fp8_tensor`: pk_jax.fp8_matmul, e4m3 operands with per-tensor factors (fast "
        "accumulation), run by cuBLASLt (tuning.fp8_gemm_library); `pk_cutlass_fp8_tensor`: "
        "the same call with pk's CUTLASS FP8 GEMM; `pk_fp8_block`: 1x128 / 128x128 factors "
        "(cuBLASLt's block scale modes); `pk_cutlass_fp8_block`: the same with pk's CUTLASS "
        "kernel, promoted every 128 of K; "
        "`xla_fp8_*`: XLA's dot on the same FP8 operands and factors, written three ways "
        "(dequantize to float32 or bfloat16 then dot, or the FP8 dot then the factors); "
        "`xla_bf16`: XLA's bf16 dot (cuBLAS) of the unquantized operands. Each recipe's "
        "rows share the baselines. `fp8_gemm_role` rows: the per-tensor GEMM of each operand "
        "pair the training step runs, at the row's M, N, K (fprop e4m3 x e4m3, fast "
        "accumulation; dgrad e5m2 x e4m3 and wgrad e4m3 x e5m2, fp32 promotion; "
        "`pk_fp8_tensor_fast`: those two with fast_accum=True, no promotion), "
        "against XLA's dot of the same FP8 operands (the three ways) and its bf16 dot.\n\n"),
    "fp8_train": (
        "One layer's training step at M x K x N (forward y = x @ w, then dx and dw; every "
        "implementation returns all three): `pk_fp8_<recipe>`: pk_jax.fp8_dot (current, "
        "delayed with given scales, block; the FP8 GEMMs by cuBLASLt); "
        "`pk_cutlass_fp8_<recipe>`: the same with pk's CUTLASS FP8 GEMMs "
        "(tuning.fp8_gemm_library forced); `pk_fp8fast_<recipe>`: "
        "Fp8Recipe(recipe, fast_gradient_accumulation=True), the gradient GEMMs without "
        "fp32 promotion; `pk_fp8wblk_block`: Fp8Recipe(\"block\", wgrad_dy_blocks=True), "
        "the weight gradient's dy^T per 128x128; `pk_tp_fp8_<recipe>`, `pk_tp_fp8fast_<recipe>`: "
        "all_gather_matmul(fp8=recipe) at world size 1 (the TP ops' FP8 sequences on one "
        "GPU); `xla_bf16`: XLA's bf16 dots (cuBLAS); "
        "`xla_fp8_current`: XLA's FP8 dots (cuBLASLt) under per-tensor current scaling "
        "written in jax.numpy (e4m3 forward, e5m2 gradient); `flax_fp8_xla`: "
        "flax.linen.Dense(dot_general_cls=nn.Fp8DotGeneralOp); `flax_fp8_direct`: "
        "nn.Fp8DirectDotGeneralOp (where this Flax has it). TFLOP/s count the three GEMMs "
        "(6 M K N). The ratio column is pk over the fastest non-pk row, bf16 included.\n\n"),
}


def _tokamax():
    try:
        import tokamax
        return tokamax
    except Exception as e:  # noqa: BLE001 - optional dependency: any import failure skips
        print(f"-- tokamax unavailable ({type(e).__name__}: {e}): its rows are skipped",
              flush=True)
        return None


class Table:
    """Rows for results/kernels.json and the markdown table."""

    def __init__(self, autosave: str = "", argv: list[str] | None = None):
        self.rows: list[dict[str, Any]] = []
        self.md: list[list[Any]] = []
        self.autosave = autosave  # a --part file, rewritten after every case
        self.argv = argv or []    # the command's arguments, kept in --part files
        self.measured: dict[str, Any] | None = None  # a --part file's machine and commit

    def add(self, op: str, case: str, fields: dict, times: dict[str, float], flops: float):
        for name, ms in times.items():
            others = {k: v for k, v in times.items() if not k.startswith("pk")}
            best_name = min(others, key=others.get) if others else None
            best = others.get(best_name)
            row = {"op": op, **fields, "implementation": name, "median_ms": ms,
                   "tflops": flops / (ms * 1e-3) / 1e12, "best_other": best_name,
                   "best_other_ms": best}
            self.rows.append(row)
            ratio = f"{best / ms:.3f}x" if name.startswith("pk") and best else "-"
            self.md.append([op, case, name, f"{ms:.3f}", f"{row['tflops']:.0f}",
                            best_name or "-", ratio])
        print(markdown_table(HEADER, self.md[-len(times):]), flush=True)
        if self.autosave:  # a run cut short keeps the cases it finished
            self.dump(self.autosave)

    def dump(self, path: str) -> None:
        """This (partial) run's rows and table lines, for --merge."""
        pathlib.Path(path).write_text(json.dumps({
            "rows": self.rows, "md": self.md, "argv": self.argv,
            "measured": self.measured or {"machine": machine(), "commit": commit()}}))

    def load(self, path: str) -> None:
        part = json.loads(pathlib.Path(path).read_text())
        self.rows += part["rows"]
        self.md += part["md"]
        self.argv = self.argv or part.get("argv", [])
        measured = part.get("measured")
        if self.measured and measured and measured != self.measured:
            raise ValueError(f"--merge: {path} was measured on {measured}, an earlier part "
                             f"on {self.measured}: not one run")
        self.measured = self.measured or measured


def _time(fns: dict[str, Callable[[], Any]], rounds: int, smoke: bool) -> dict[str, float]:
    if smoke:
        runs = interleaved_ms(fns, rounds=1, calls=2, batches=1)
    else:
        runs = interleaved_ms(fns, rounds=rounds, calls=10, batches=3)
    return {name: float(np.median(t)) for name, t in runs.items()}


def _fresh_keys(n: int) -> jax.Array:
    """`n` keys from a seed drawn anew each run: fresh inputs, made on the device."""
    return jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)), n)


def _close(name: str, got, want, tol: float) -> None:
    """Relative Frobenius error of `got` against `want` (computed where they
    live, in float32), or an error."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    err = float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
    if not np.isfinite(err) or err > tol:
        raise AssertionError(f"{name}: relative error {err:.2e} > {tol:.0e}")


# --- attention ----------------------------------------------------------------

def attention_case(c) -> str:
    b, s, h, hkv, d, causal, dtype = c
    return f"b{b} s{s} h{h}/{hkv} d{d} {'causal' if causal else 'full'} {dtype}"


def gemm_case(c) -> str:
    return "x".join(map(str, c))


def attention(table: Table, cases, rounds: int, smoke: bool, tokamax,
              skip: frozenset = frozenset()) -> None:
    mesh = one_axis_mesh(jax.devices()[:1], "sp")
    spec = P(None, "sp")
    for b, s, h, hkv, d, causal, dtype in cases:
        keys = _fresh_keys(4)
        q = jax.random.normal(keys[0], (b, s, h, d), dtype)
        k = jax.random.normal(keys[1], (b, s, hkv, d), dtype)
        v = jax.random.normal(keys[2], (b, s, hkv, d), dtype)
        do = jax.random.normal(keys[3], (b, s, h, d), dtype)
        ring = lambda **kw: jax.shard_map(
            lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal, **kw),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        impls: dict[str, Callable] = {
            "pk": ring(),  # auto: the measured choice (pk_jax/tuning.py)
            "pk_kernel": ring(mechanism="copy_engine"),  # pk's own fused kernel
            # pk's forward kernel, cuDNN's backward fed its output and lse
            # (an alternative of tuning.single_gpu_attention; the same
            # forward as pk_kernel, so timed with the backward only)
            "pk_kernel_cudnn_bwd": ring(),
            "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"),
        }
        if tokamax is not None:
            for impl in ("mosaic", "triton"):
                impls[f"tokamax_{impl}"] = (lambda q, k, v, impl=impl:
                                            tokamax.dot_product_attention(
                                                q, k, v, is_causal=causal,
                                                implementation=impl))
        impls = {name: f for name, f in impls.items() if name not in skip}
        case = attention_case((b, s, h, hkv, d, causal, dtype))
        fields = {"batch": b, "seq": s, "heads": h, "kv_heads": hkv, "head_dim": d,
                  "causal": causal, "dtype": dtype}
        flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
        for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            fns, outs = {}, {}
            for name, f in impls.items():
                if mode == "fwd" and name == "pk_kernel_cudnn_bwd":
                    continue
                if mode == "fwd":
                    g = jax.jit(f)
                else:
                    g = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(
                        f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))
                choice = {"pk_kernel_cudnn_bwd": "kernel_fwd_cudnn_bwd"}.get(name)
                try:
                    with (tuning.forced(single_gpu_attention=choice) if choice
                          else contextlib.nullcontext()):  # traced at the first call
                        outs[name] = jax.block_until_ready(g(q, k, v))
                except Exception as e:  # noqa: BLE001 - a baseline that does not take the case
                    if name == "pk":
                        raise
                    print(f"-- {name} {mode} {case}: not run ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})", flush=True)
                    continue
                fns[name] = lambda g=g: g(q, k, v)
            ref = outs.get("cudnn", next((o for n, o in outs.items() if n != "pk"), None))
            if ref is not None:  # pk against a baseline's output before timing
                for name in ("pk", "pk_kernel", "pk_kernel_cudnn_bwd"):
                    for got, want in zip(jax.tree.leaves(outs.get(name, ())),
                                         jax.tree.leaves(ref)):
                        _close(f"attention {name} {mode} {case}", got, want, 2e-2)
            times = _time(fns, rounds, smoke)
            table.add(f"attention_{mode}", case, {**fields, "mode": mode}, times, flops * mult)


# --- bf16 GEMM -------------------------------------------------------------------

def gemm(table: Table, shapes, rounds: int, smoke: bool) -> None:
    mesh = one_axis_mesh(jax.devices()[:1], "x")
    pk_fwd = jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "x", mechanism="chunked"),
                           mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    xla_fwd = lambda x, w: x @ w
    for m, n, k in shapes:
        keys = _fresh_keys(3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * k ** -0.5
        dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        case = gemm_case((m, n, k))
        fields = {"m": m, "n": n, "k": k, "dtype": "bfloat16"}
        for mode, impls, flops in (
                ("fwd", {"pk": pk_fwd, "xla": xla_fwd}, 2.0 * m * n * k),
                ("fwd+bwd", {"pk": pk_fwd, "xla": xla_fwd}, 6.0 * m * n * k)):
            fns, outs = {}, {}
            for name, f in impls.items():
                if mode == "fwd":
                    g = jax.jit(f)
                else:  # y, then dx = dy w^T and dw = x^T dy (pk: one fused backward call);
                    # y is returned, so neither side can drop the forward GEMM
                    def g(x, w, dy, f=f):
                        y, vjp = jax.vjp(f, x, w)
                        return y, vjp(dy)
                    g = jax.jit(g)
                args = (x, w) if mode == "fwd" else (x, w, dy)
                outs[name] = jax.block_until_ready(g(*args))
                fns[name] = lambda g=g, args=args: g(*args)
            for got, want in zip(jax.tree.leaves(outs["pk"]), jax.tree.leaves(outs["xla"])):
                _close(f"gemm {mode} {case}", got, want, 1e-2)
            table.add(f"gemm_{mode}", case, {**fields, "mode": mode}, _time(fns, rounds, smoke),
                      flops)


# --- FP8 GEMM ------------------------------------------------------------------

def _xla_fp8_variants():
    """The ways a JAX user writes an FP8 GEMM for XLA: dequantized operands
    into a dot (the pattern XLA's GEMM rewriter turns into one cuBLASLt FP8
    call with the factors as scales), in float32 or bfloat16, or a dot of the
    FP8 operands themselves with the factors applied after. Every one is
    timed; the fastest is the row's baseline."""
    dims = (((1,), (1,)), ((), ()))

    def dequant(dtype):
        def f(a, b, sa, sb):
            deq = lambda q, s: q.astype(dtype) * s.astype(dtype)
            return lax.dot_general(deq(a, sa), deq(b, sb), dims,
                                   preferred_element_type=dtype).astype(jnp.bfloat16)
        return f

    def direct(a, b, sa, sb):
        out = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
        return (out * (sa * sb)).astype(jnp.bfloat16)
    return {"xla_fp8_dq_f32": dequant(jnp.float32), "xla_fp8_dq_bf16": dequant(jnp.bfloat16),
            "xla_fp8_direct": direct}


def fp8(table: Table, shapes, rounds: int, smoke: bool) -> None:
    xla_fp8 = {name: jax.jit(f) for name, f in _xla_fp8_variants().items()}
    for (ta, tb) in sorted(set(FP8_ROLES.values())):
        probe = (jnp.zeros((256, 256), ta), jnp.zeros((256, 256), tb), jnp.float32(1),
                 jnp.float32(1))
        for name, f in xla_fp8.items():
            text = f.lower(*probe).compile().as_text()
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
            print(f"-- {name} {ta} x {tb}: XLA's custom calls {calls or 'none'}", flush=True)
    for m, n, k in shapes:
        if k % 128 or n % 128:
            continue
        kx, kw = _fresh_keys(2)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (n, k), jnp.bfloat16) * k ** -0.5
        xb, _, fxb, _ = pk_jax.fp8_quantize(x, "rows")
        _, wbt, fwb, _ = pk_jax.fp8_quantize(w.T, "blocks", rowwise=False, transposed=True)
        dot_t = lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())))
        block = lambda: lambda a, b, fa, fb: pk_jax.fp8_matmul(a, b, fa, fb, scaling="block")
        tensor = lambda **kw: lambda *a: pk_jax.fp8_matmul(*a, **kw)
        calls = {  # (jitted function, its arguments): operands are arguments, not constants
            "pk_fp8_block": (jax.jit(block()), (xb, wbt, fxb, fwb)),
            "pk_cutlass_fp8_block": (_lowered_with_cutlass(block, xb, wbt, fxb, fwb),
                                     (xb, wbt, fxb, fwb)),
            "xla_bf16": (jax.jit(dot_t), (x, w)),
        }
        for role, (ta, tb) in FP8_ROLES.items():  # the same x and w in the role's formats
            xq, _, fx, _ = pk_jax.fp8_quantize(x, "tensor", ta)
            wq, _, fw, _ = pk_jax.fp8_quantize(w, "tensor", tb)
            calls[f"pk_fp8_tensor {role}"] = (jax.jit(tensor()), (xq, wq, fx, fw))
            if role != "fprop":  # e4m3 x e4m3 accumulates fast regardless
                calls[f"pk_fp8_tensor_fast {role}"] = (jax.jit(tensor(fast_accum=True)),
                                                       (xq, wq, fx, fw))
            calls[f"pk_cutlass_fp8_tensor {role}"] = (
                _lowered_with_cutlass(tensor, xq, wq, fx, fw), (xq, wq, fx, fw))
            calls.update({f"{name} {role}": (f, (xq, wq, fx.reshape(()), fw.reshape(())))
                          for name, f in xla_fp8.items()})
        _check_libraries(calls)
        fns = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in calls.items()}
        outs = {name: jax.block_until_ready(f()) for name, f in fns.items()}
        case = gemm_case((m, n, k))
        for role in FP8_ROLES:
            for name in (*xla_fp8, "pk_cutlass_fp8_tensor", "pk_fp8_tensor_fast"):
                if f"{name} {role}" in outs:
                    _close(f"fp8 {role} {case} vs {name}", outs[f"pk_fp8_tensor {role}"],
                           outs[f"{name} {role}"], 1e-2)
        _close(f"fp8 block {case}", outs["pk_fp8_block"], outs["xla_bf16"], 6e-2)
        _close(f"fp8 block {case} CUTLASS", outs["pk_cutlass_fp8_block"], outs["pk_fp8_block"],
               1e-2)
        times = _time(fns, rounds, smoke)
        fields = {"m": m, "n": n, "k": k}
        sub = {"pk_fp8_block": times["pk_fp8_block"],
               "pk_cutlass_fp8_block": times["pk_cutlass_fp8_block"],
               "xla_bf16": times["xla_bf16"],
               **{name: times[f"{name} fprop"] for name in xla_fp8}}
        table.add("fp8_gemm_block", case, {**fields, "dtype": "float8_e4m3fn",
                                           "recipe": "block"}, sub, 2.0 * m * n * k)
        for role, (ta, tb) in FP8_ROLES.items():
            sub = {"pk_fp8_tensor": times[f"pk_fp8_tensor {role}"],
                   **({"pk_fp8_tensor_fast": times[f"pk_fp8_tensor_fast {role}"]}
                      if role != "fprop" else {}),
                   "pk_cutlass_fp8_tensor": times[f"pk_cutlass_fp8_tensor {role}"],
                   "xla_bf16": times["xla_bf16"],
                   **{name: times[f"{name} {role}"] for name in xla_fp8}}
            table.add("fp8_gemm_tensor", f"{case} {role}",
                      {**fields, "dtype": f"{ta} x {tb}", "recipe": "tensor", "role": role},
                      sub, 2.0 * m * n * k)


# --- one layer's FP8 training step ---------------------------------------------

def _xla_fp8_current_dot():
    """x @ w with XLA's FP8 dots under per-tensor current scaling, as a JAX
    user writes it: each operand scaled by fp8_max / amax and cast (e4m3
    forward, e5m2 output gradient), the dot of the FP8 operands in float32
    with the factors applied after (XLA's rewriter: one cuBLASLt FP8 call)."""
    def q(a, dtype):
        amax = jnp.max(jnp.abs(a.astype(jnp.float32)))
        fmax = float(jnp.finfo(dtype).max)
        scale = jnp.where(amax > 0, fmax / amax, 1.0)
        return jnp.clip(a.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype), 1.0 / scale

    def dot(a, sa, b, sb, dims):
        out = lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
        return (out * (sa * sb)).astype(jnp.bfloat16)

    @jax.custom_vjp
    def f(x, w):
        return f_fwd(x, w)[0]

    def f_fwd(x, w):
        (xq, sx), (wq, sw) = q(x, jnp.float8_e4m3fn), q(w, jnp.float8_e4m3fn)
        return dot(xq, sx, wq, sw, ((1,), (0,))), (xq, sx, wq, sw)

    def f_bwd(res, dy):
        xq, sx, wq, sw = res
        dq, sd = q(dy, jnp.float8_e5m2)
        return dot(dq, sd, wq, sw, ((1,), (1,))), dot(xq, sx, dq, sd, ((0,), (0,)))

    f.defvjp(f_fwd, f_bwd)
    return f


def _flax_fp8_steps(x, w, dy):
    """Flax's FP8 Dense layers (delayed scaling, their amax histories and
    scales in the variables) with kernel w: {name: step(x, w, dy) -> (y, dx,
    dw)} for each op this Flax has, at delayed scaling's steady state: the
    histories and scales of two earlier steps on (x, w, dy) (at
    initialization every scale is 1, which puts w's small values among
    e4m3's subnormals: y 5.8e-2 off the bf16 step at 4096x8192x28672)."""
    import warnings

    import flax.linen as nn
    k, n = w.shape
    steps = {}
    for name, op in (("flax_fp8_xla", "Fp8DotGeneralOp"),
                     ("flax_fp8_direct", "Fp8DirectDotGeneralOp")):
        if not hasattr(nn, op):
            print(f"-- {name}: this Flax has no nn.{op}: its rows are skipped", flush=True)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            layer = nn.Dense(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                             dot_general_cls=getattr(nn, op))
            variables = layer.init(jax.random.key(0), jnp.zeros((16, k), jnp.bfloat16))
            variables = {**variables, "params": {**variables["params"], "kernel": w}}
            for _ in range(2):  # the fp8 variables' "gradients" are their next values
                _, vjp = jax.vjp(lambda x, v, layer=layer: layer.apply(v, x), x, variables)
                fp8_state = vjp(dy)[1]["_overwrite_with_gradient"]
                variables = {**variables, "_overwrite_with_gradient": fp8_state}

        def step(x, w, dy, variables=variables, layer=layer):
            v = {**variables, "params": {**variables["params"], "kernel": w}}
            y, vjp = jax.vjp(lambda x, v: layer.apply(v, x), x, v)
            dx, dv = vjp(dy)
            return y, dx, dv["params"]["kernel"]
        steps[name] = jax.jit(step)
    return steps


def _lowered_with_cutlass(make, *args):
    """`make()` (a new function object each call) jitted and compiled for
    `args` with pk's CUTLASS kernels running the FP8 GEMMs
    (tuning.fp8_gemm_library forced; cuBLASLt otherwise). A function of its
    own: JAX caches the lowering of a function it traced once, so lowering
    the default rows' function here would make their calls run CUTLASS too."""
    with tuning.forced(fp8_gemm_library="cutlass"):
        return jax.jit(make()).lower(*args).compile()


def _check_libraries(calls: dict[str, tuple[Callable, tuple]]) -> None:
    """The FP8 GEMMs of every default pk row ({name: (jitted function, its
    arguments)}; the `pk_cutlass_*` rows are not) lower to cuBLASLt where
    the extension found it (pk_jax/tuning.py: fp8_gemm_library): each row
    times what a user gets, not a CUTLASS lowering left in JAX's caches by a
    `_lowered_with_cutlass` row."""
    if not (runtime.available() and runtime.extension().cublaslt_version() > 0):
        return
    for name, (f, args) in calls.items():
        if name.startswith("pk") and "cutlass" not in name and \
                "library = 0" in f.lower(*args).as_text():
            raise RuntimeError(f"{name}: its FP8 GEMMs lowered to CUTLASS, not cuBLASLt")


def fp8_train_inputs(m: int, k: int, n: int):
    """Fresh x [m, k], w [k, n] (unit-variance outputs) and dy [m, n], bf16."""
    keys = _fresh_keys(3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * k ** -0.5
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    return x, w, dy


def fp8_train_steps(x, w, dy, flax: bool = True) -> dict[str, Callable]:
    """Every implementation of the fp8_train section: {name: jitted step(x, w,
    dy) -> (y, dx, dw)}, Flax's FP8 layers unless `flax` is False. Delayed
    scaling gets the scales an amax history of earlier steps would give
    (this step's amaxes)."""
    fmax = {d: float(jnp.finfo(d).max) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2)}
    scales = tuple(jnp.float32(fmax[d]) / jnp.max(jnp.abs(a.astype(jnp.float32)))
                   for a, d in ((x, jnp.float8_e4m3fn), (w, jnp.float8_e4m3fn),
                                (dy, jnp.float8_e5m2)))
    mesh = one_axis_mesh(jax.devices()[:1], "x")

    def step_of(f):
        def step(x, w, dy):
            y, vjp = jax.vjp(f, x, w)
            return (y, *vjp(dy))
        return jax.jit(step)

    def delayed_of(recipe):
        def delayed(x, w, dy):
            (y, _), vjp = jax.vjp(lambda x, w, s: pk_jax.fp8_dot(x, w, recipe, scales=s),
                                  x, w, scales)
            dx, dw, _ = vjp((dy, (jnp.zeros(1, jnp.float32),) * 2))
            return y, dx, dw
        return jax.jit(delayed)

    def tp_of(recipe):
        return step_of(jax.shard_map(
            lambda x, w: pk_jax.all_gather_matmul(x, w, "x", fp8=recipe), mesh=mesh,
            in_specs=(P("x"), P()), out_specs=P("x")))
    fast = {r: pk_jax.Fp8Recipe(r, fast_gradient_accumulation=True)
            for r in ("current", "delayed")}
    # factories: each call a new function (_lowered_with_cutlass)
    current = lambda: step_of(lambda x, w: pk_jax.fp8_dot(x, w, "current"))
    delayed = lambda: delayed_of("delayed")
    block = lambda: step_of(lambda x, w: pk_jax.fp8_dot(x, w, "block"))
    return {
        "pk_fp8_current": current(),
        "pk_fp8_delayed": delayed(),
        "pk_fp8fast_current": step_of(lambda x, w: pk_jax.fp8_dot(x, w, fast["current"])),
        "pk_fp8fast_delayed": delayed_of(fast["delayed"]),
        "pk_cutlass_fp8_current": _lowered_with_cutlass(current, x, w, dy),
        "pk_cutlass_fp8_delayed": _lowered_with_cutlass(delayed, x, w, dy),
        "pk_fp8_block": block(),
        "pk_fp8wblk_block": step_of(lambda x, w: pk_jax.fp8_dot(
            x, w, pk_jax.Fp8Recipe("block", wgrad_dy_blocks=True))),
        "pk_cutlass_fp8_block": _lowered_with_cutlass(block, x, w, dy),
        "pk_tp_fp8_current": tp_of("current"),
        "pk_tp_fp8fast_current": tp_of(fast["current"]),
        "pk_tp_fp8_block": tp_of("block"),
        "xla_bf16": step_of(lambda x, w: x @ w),
        "xla_fp8_current": step_of(_xla_fp8_current_dot()),
        **(_flax_fp8_steps(x, w, dy) if flax else {}),
    }


def fp8_train(table: Table, shapes, rounds: int, smoke: bool, flax: bool = True) -> None:
    for m, k, n in shapes:
        x, w, dy = fp8_train_inputs(m, k, n)
        steps = fp8_train_steps(x, w, dy, flax)
        _check_libraries({name: (f, (x, w, dy)) for name, f in steps.items()})
        case = f"{m}x{k}x{n}"
        outs = {}
        for name, f in steps.items():  # the first call compiles: its time, for the log
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(f(x, w, dy))
            print(f"-- fp8_train {case} {name}: first call {time.perf_counter() - t0:.1f} s",
                  flush=True)
        fns = {name: (lambda f=f: f(x, w, dy)) for name, f in steps.items()}
        for name, got in outs.items():  # y, dx, dw against the bf16 step's
            for what, g, r, tol in zip(("y", "dx", "dw"), got, outs["xla_bf16"],
                                       (5e-2, 1e-1, 1e-1)):
                _close(f"fp8_train {case} {name} {what}", g, r, tol)
        times = _time(fns, rounds, smoke)
        fields = {"m": m, "k": k, "n": n}
        baselines = {name: t for name, t in times.items() if not name.startswith("pk")}
        for recipe in ("current", "delayed", "block"):
            pk = {name: t for name, t in times.items()
                  if name.startswith("pk") and name.endswith(f"_{recipe}")}
            table.add("fp8_train", f"{case} {recipe}", {**fields, "recipe": recipe},
                      {**pk, **baselines}, 6.0 * m * k * n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {', '.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="the first two cases of each section")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, nothing written")
    ap.add_argument("--match", default="", help="only the cases whose label holds this text")
    ap.add_argument("--part", default="",
                    help="I/N: the I-th of N consecutive slices of each section's cases "
                         "(1-based), its rows written to --part-out for --merge")
    ap.add_argument("--part-out", default="kernels_part.json")
    ap.add_argument("--no-flax", action="store_true",
                    help="fp8_train without Flax's FP8 layers (compiling them takes minutes a "
                         "shape): their rows are absent")
    ap.add_argument("--skip", default="",
                    help="comma-separated attention implementations not to run (e.g. "
                         "tokamax_triton, never the fastest other: its rows are absent)")
    ap.add_argument("--merge", nargs="*", default=None,
                    help="write the results of the --part runs of these files (in order) "
                         "as one run's, timing nothing")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")

    def cut(cases, label):
        cases = [c for c in cases if args.match in label(c)]
        if args.part:
            i, n = map(int, args.part.split("/"))
            cases = cases[(i - 1) * len(cases) // n: i * len(cases) // n]
        return cases[:2] if args.quick else cases

    table = Table(autosave=args.part_out if args.part else "",
                  argv=sys.argv[1:] if args.part else None)
    if args.merge is not None:  # the --part runs' rows, written as one run's
        for path in args.merge:
            table.load(path)
        only = {section_of(r["op"]) for r in table.rows}
        command = "python benchmarks/kernels.py " + (
            _parts_arguments(table.argv) or f"--only {','.join(sorted(only))} --part I/N")
        return _write(table, only, f"{command} (I = 1..{len(args.merge)}), then --merge")
    if "attention" in only:
        cases = SMOKE_ATTENTION if args.smoke else cut(ATTENTION_CASES, attention_case)
        attention(table, cases, args.rounds, args.smoke, _tokamax(),
                  frozenset(filter(None, args.skip.split(","))))
    if "gemm" in only:
        shapes = SMOKE_GEMM if args.smoke else cut(GEMM_SHAPES, gemm_case)
        gemm(table, shapes, args.rounds, args.smoke)
    if "fp8" in only:
        shapes = SMOKE_GEMM if args.smoke else cut(GEMM_SHAPES, gemm_case)
        fp8(table, shapes, args.rounds, args.smoke)
    if "fp8_train" in only:
        shapes = SMOKE_FP8_TRAIN if args.smoke else cut(FP8_TRAIN_SHAPES,
                                                         lambda c: "x".join(map(str, c)))
        fp8_train(table, shapes, args.rounds, args.smoke, flax=not args.no_flax)
    pk_jax.check_errors()
    if args.part:
        table.dump(args.part_out)
        print(f"--part {args.part}: rows in {args.part_out} (--merge writes the results)")
    elif args.smoke or args.quick or args.match:
        print("SMOKE_OK (nothing written)" if args.smoke else
              "--quick / --match: results and RESULTS.md left as they are")
    else:
        return _write(table, only, "python benchmarks/kernels.py " + " ".join(sys.argv[1:]))
    print(COLUMNS + markdown_table(HEADER, table.md))
    return 0


def _parts_arguments(argv: list[str]) -> str:
    """A --part run's arguments as the command of all parts: its slice as
    I/N, without --part-out (only --part's value is rewritten: a --match
    text such as "32/4" stays)."""
    kept, prev = [], ""
    for a in argv:
        if a.startswith("--part-out") or prev == "--part-out":
            pass
        elif prev == "--part":
            kept.append("I/N")
        else:
            kept.append("--part=I/N" if a.startswith("--part=") else a)
        prev = a
    return " ".join(kept)


def section_of(op: str) -> str:
    """The section whose run made rows of `op` (fp8_gemm_* rows: fp8)."""
    return op if op in SECTIONS else op.split("_")[0]


def _write(table: Table, only, command: str) -> int:
    """One file and RESULTS.md section per section run: each one run's rows."""
    for section in sorted(only):
        rows = [r for r in table.rows if section_of(r["op"]) == section]
        md_rows = [m for m in table.md if section_of(m[0]) == section]
        write_results(f"kernels_{section}", rows,
                      IMPLS[section] + COLUMNS + markdown_table(HEADER, md_rows), command,
                      measured=table.measured)
    print(COLUMNS + markdown_table(HEADER, table.md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
