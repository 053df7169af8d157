"""Tensor-parallel matmuls: pk_jax against XLA and against gemm-only (the
same local GEMM with no communication: the floor perfect overlap reaches),
in one run. XLA's rows:

  * "xla": the collective and the dot as written inside shard_map
    (all_gather + dot, dot + psum_scatter, dot + psum);
  * "xla_windowed": XLA's own collective matmul: the same product as a
    global-view jit program that XLA partitions from the operands'
    shardings, compiled with the windowed-einsum flags (WINDOWED_OPTIONS:
    every size decomposed into a loop of per-peer dots overlapped with the
    transfers, on several streams); whether the compiled program holds the
    windowed loop is printed. Left out, with the reason printed, where the
    compiler refuses the flags.

FP8 (fp8_all_gather_matmul, fp8_matmul_reduce_scatter: the forwards on bf16
operands, quantized inside each call): pk's fp8="current" (per-tensor
factors, the FP8 GEMMs inside the host sequences) and fp8="block" against
"xla" (bf16) and XLA's FP8 as a JAX user writes it: x quantized with the
axis-wide amax, the FP8 rows gathered (or the bf16 partials reduce-scattered),
then each of kernels.py's ways of writing XLA's FP8 dot ("xla_fp8_*").

Every ratio is against the fastest XLA row (named in each row), and every
output is checked against "xla"'s before timing (FP8 rows to FP8's error).

Usage: python benchmarks/tp_matmul.py [--quick] [--only OP[,OP...]] [--smoke]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from common import (bench_setup, interleaved_ms, markdown_table, one_axis_mesh, time_ms,
                    write_results)

# XLA's collective matmul: the SPMD partitioner's windowed einsum at every
# size, its loop's dots on several streams (XLA debug options, per compile).
WINDOWED_OPTIONS = {"xla_gpu_multi_streamed_windowed_einsum": True,
                    "xla_gpu_threshold_for_windowed_einsum_mib": 0}
# The XLA rows a pk row is compared with (the fastest of those present).
XLA_FP8_DOTS = ("xla_fp8_dq_f32", "xla_fp8_dq_bf16", "xla_fp8_direct")
XLA_IMPLS = ("xla", "xla_windowed") + XLA_FP8_DOTS

# Global M x K x N: the shapes XLA's collective matmuls were first measured at on
# 2 x H200 (a square pair, then an MLP layer's: hidden 8192, ffn 28672).
AG_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 28672)]
RS_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 28672, 8192)]
# matmul_all_reduce (K global: K / n per rank): issue 19's large shape, then
# decode-sized M (the one_shot range of pk_jax/tuning.py).
AR_SHAPES = [(8192, 8192, 8192)] + [(m, 8192, 8192) for m in (16, 32, 64, 128, 256)]
# World-size-1 GEMMs: the square one, then the MLP layer's per-rank GEMMs on
# 2 GPUs (all_gather_matmul's 8192 x 8192 @ 8192 x 14336 chunk and
# matmul_reduce_scatter's 8192 x 14336 @ 14336 x 8192), then a small one.
WS1_SHAPES = [(8192, 8192, 8192), (8192, 8192, 14336), (8192, 14336, 8192), (4096, 4096, 4096)]
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "gemm_world_size_1",
       "mlp_fwd_bwd", "fp8_all_gather_matmul", "fp8_matmul_reduce_scatter",
       "fp8_gemm_world_size_1")
# --smoke (CPU too): one tiny shape per op (M, K and N multiples of 8 devices;
# FP8 block factors: K, N and the rows per device multiples of 128).
SMOKE = {"ag": (256, 128, 256), "rs": (256, 256, 128), "ar": (64, 256, 128),
         "ws1": (128, 128, 128), "mlp": (256, 128, 512), "fp8_ag": (1024, 128, 1024),
         "fp8_rs": (1024, 1024, 128), "fp8_ws1": (256, 256, 256)}
FP8_TOL = 6e-2  # FP8 rows against the bf16 "xla" row (max error over max |y|)


def _put(mesh, shape, spec, rng, scale=1.0):
    a = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, jnp.bfloat16)
    return jax.device_put(a, NamedSharding(mesh, spec))


def ag_impls(mesh, mechanism="auto"):
    specs = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
    return {
        "pk": jax.jit(jax.shard_map(
            lambda x, w: pk_jax.all_gather_matmul(x, w, "x", mechanism=mechanism), **specs)),
        "xla": jax.jit(jax.shard_map(
            lambda x, w: lax.all_gather(x, "x", tiled=True) @ w, **specs)),
        # the local GEMM alone: every rank multiplies M rows (its rows n times)
        "gemm_only": jax.jit(jax.shard_map(
            lambda x, w: jnp.concatenate([x] * lax.axis_size("x")) @ w, **specs)),
    }


def rs_impls(mesh):
    specs = dict(mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x"))
    n = mesh.size
    return {
        "pk": jax.jit(jax.shard_map(lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "x"),
                                    **specs)),
        "xla": jax.jit(jax.shard_map(
            lambda x, w: lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True),
            **specs)),
        "gemm_only": jax.jit(jax.shard_map(lambda x, w: (x @ w)[: x.shape[0] // n], **specs)),
    }


def ar_impls(mesh):
    specs = dict(mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P())
    sm = lambda f: jax.jit(jax.shard_map(f, **specs))
    impls = {"pk": sm(lambda x, w: pk_jax.matmul_all_reduce(x, w, "x"))}
    for mechanism in ("chunked", "one_shot"):  # both, to check tuning.py's threshold
        impls[f"pk_{mechanism}"] = sm(
            lambda x, w, m=mechanism: pk_jax.matmul_all_reduce(x, w, "x", mechanism=m))
    impls["xla"] = sm(lambda x, w: lax.psum(x @ w, "x"))
    # the local GEMM alone (shard_map's check_vma would call its result varying)
    impls["gemm_only"] = jax.jit(jax.shard_map(lambda x, w: x @ w, check_vma=False, **specs))
    return impls


def mlp_impls(mesh):
    def loss(impl):
        def body(x, w1, w2):
            if impl == "pk":
                h = pk_jax.all_gather_matmul(x, w1, "x")
                return pk_jax.matmul_reduce_scatter(jax.nn.gelu(h), w2, "x")
            if impl == "xla":
                h = lax.all_gather(x, "x", tiled=True) @ w1
                return lax.psum_scatter(jax.nn.gelu(h) @ w2, "x", scatter_dimension=0,
                                        tiled=True)
            # gemm_only: the same six local GEMMs (forward and backward) with
            # no communication: our rows stand in for the gathered ones, and
            # our slice of the product for the reduce-scattered one.
            n = lax.axis_size("x")
            h = jnp.concatenate([x] * n) @ w1
            return (jax.nn.gelu(h) @ w2)[: x.shape[0]]
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x", None)),
                          out_specs=P("x"))
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    return {impl: jax.jit(jax.value_and_grad(loss(impl), (0, 1, 2)))
            for impl in ("pk", "xla", "gemm_only")}


def _xla_fp8_dots():
    """kernels.py's ways of writing XLA's FP8 dot, (a, b^T, factors) -> bf16."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from kernels import _xla_fp8_variants
    return _xla_fp8_variants()


def _xla_quantize(a, names=()):
    """a -> (e4m3 a, its factor) per tensor in jax.numpy, the amax over the
    axes `names` (pmax), as the current recipe does."""
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)))
    amax = lax.pmax(amax, names) if names else amax
    scale = jnp.where(amax > 0, 448.0 / amax, 1.0)
    q = jnp.clip(a.astype(jnp.float32) * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q, (1.0 / scale).reshape(1)


def fp8_impls(mesh, op: str):
    """pk's FP8 recipes and XLA's FP8 (kernels.py's dots) for `op`'s forward
    on bf16 operands, with "xla" (bf16) as the reference row."""
    if op == "fp8_all_gather_matmul":
        specs = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
        pk_op, xla_bf16 = pk_jax.all_gather_matmul, ag_impls(mesh)["xla"]

        def xla_fp8(dot):
            def f(x, w):
                xq, sx = _xla_quantize(x, "x")
                wq, sw = _xla_quantize(w)
                return dot(lax.all_gather(xq, "x", tiled=True), wq.T, sx, sw)
            return f
    else:
        specs = dict(mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x"))
        pk_op, xla_bf16 = pk_jax.matmul_reduce_scatter, rs_impls(mesh)["xla"]

        def xla_fp8(dot):
            def f(x, w):
                (xq, sx), (wq, sw) = _xla_quantize(x), _xla_quantize(w)
                return lax.psum_scatter(dot(xq, wq.T, sx, sw), "x", scatter_dimension=0,
                                        tiled=True)
            return f
    sm = lambda f: jax.jit(jax.shard_map(f, **specs))
    impls = {f"pk_fp8_{recipe}": sm(lambda x, w, r=recipe: pk_op(x, w, "x", fp8=r))
             for recipe in ("current", "block")}
    impls.update({name: sm(xla_fp8(dot)) for name, dot in _xla_fp8_dots().items()})
    return {**impls, "xla": xla_bf16}


def fp8_ws1_impls(mesh):
    """World size 1: all_gather_matmul and matmul_reduce_scatter with each
    FP8 recipe, that recipe's fp8_dot (the same quantization and GEMM, no
    collective op around them) and XLA's FP8 dots, on bf16 x [M, K], w [K, N]."""
    specs = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P("x"))
    sm = lambda f: jax.jit(jax.shard_map(f, **specs))
    impls = {}
    for r in ("current", "block"):
        impls[f"pk_ag_{r}"] = sm(lambda x, w, r=r: pk_jax.all_gather_matmul(x, w, "x", fp8=r))
        impls[f"pk_rs_{r}"] = sm(
            lambda x, w, r=r: pk_jax.matmul_reduce_scatter(x, w, "x", fp8=r))
        impls[f"fp8_dot_{r}"] = sm(lambda x, w, r=r: pk_jax.fp8_dot(x, w, r))
    ag = fp8_impls(mesh, "fp8_all_gather_matmul")
    return {**impls, **{name: ag[name] for name in XLA_FP8_DOTS}}


def mlp_global(mesh):
    """The MLP pair's loss as a global-view program (XLA partitions it from
    the operands' shardings and these constraints): xla_windowed's."""
    pin = lambda a, spec: lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def loss(x, w1, w2):
        h = pin(x @ w1, P(None, "x"))
        return jnp.sum(pin(jax.nn.gelu(h) @ w2, P("x", None)).astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))


_COLLECTIVE = re.compile(
    r" (all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\(")


def windowed(mesh, f, out_spec, *args) -> dict:
    """{"xla_windowed": f (a global-view program) compiled for `args` (their
    shardings, the result's `out_spec`; None: XLA's choice) with
    WINDOWED_OPTIONS}, or {} with the reason printed where the compiler
    refuses them. Prints what the compiled program communicates with (a
    windowed einsum: collective-permutes in place of the all-gather /
    reduce-scatter)."""
    shardings = {} if out_spec is None else dict(out_shardings=NamedSharding(mesh, out_spec))
    try:
        compiled = jax.jit(f, **shardings).lower(*args).compile(
            compiler_options=WINDOWED_OPTIONS)
    except Exception as e:  # noqa: BLE001: reported, row left out
        print(f"xla_windowed left out: the compiler refused {WINDOWED_OPTIONS}: "
              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        return {}
    text = compiled.as_text()
    ops = collections.Counter(_COLLECTIVE.findall(text))
    print(f"xla_windowed {' '.join(str(a.shape) for a in args)}: flags accepted by the "
          f"{jax.devices()[0].platform} compiler; windowed_dot_general loop: "
          f"{'yes' if 'windowed_dot_general' in text else 'no'}; collectives "
          f"{dict(ops) or 'none'}", flush=True)
    return {"xla_windowed": compiled}


def checked(impls: dict, *args, tol: float = 2e-2) -> dict:
    """`impls` less those whose output differs from "xla"'s by more than
    `tol` of its largest value (printed); the gemm-only floor computes
    something else and is not checked."""
    leaves = lambda f: [np.asarray(a, np.float32) for a in jax.tree.leaves(f(*args))]
    want = leaves(impls["xla"])
    out = {}
    for name, f in impls.items():
        errs = [] if name == "gemm_only" else [
            float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)
            for a, b in zip(leaves(f), want)]
        if errs and max(errs) > tol:
            print(f"!!!! {name}: FAILED the check against xla (relative error "
                  f"{max(errs):.2e}): left out", flush=True)
            continue
        out[name] = f
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first shape of each op only")
    ap.add_argument("--only", default=",".join(OPS),
                    help=f"comma-separated subset of {', '.join(OPS)}")
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny shape per op, few calls, nothing written (CPU too)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(OPS):
        ap.error(f"--only: unknown {sorted(only - set(OPS))}; choose from {OPS}")
    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    timing = dict(calls=2, batches=1, warmup=1) if args.smoke else {}
    # Each op's channel stages its largest shape in a power-of-two region
    # (pk_jax/_channels.py): this sweep's regions add up to ~1 GiB.
    pk_jax.configure(workspace_bytes=3 << 30)

    def shapes(op, full, quick, smoke):
        if op not in only:
            return []
        return [smoke] if args.smoke else full[:quick] if args.quick else full

    def record(op, shape, times, flops, gpus=n, dtype="bfloat16"):
        xla = {name: times[name] for name in XLA_IMPLS if name in times}
        best = min(xla, key=xla.get)
        base, floor = xla[best], times.get("gemm_only")
        for name, ms in times.items():
            rows.append({"op": op, "shape": list(shape), "dtype": dtype,
                         "implementation": name, "median_ms": ms, "baseline": best,
                         "baseline_median_ms": base, "xla_median_ms": xla,
                         "gemm_only_ms": floor,
                         "tflops_per_gpu": flops / gpus / (ms * 1e-3) / 1e12})
            table.append([op, "x".join(map(str, shape)), name, f"{ms:.3f}",
                          f"{flops / gpus / (ms * 1e-3) / 1e12:.0f}",
                          f"{ms / floor:.3f}" if floor else "-", best, f"{base / ms:.2f}x"])
        print(markdown_table(HEADER, table[-len(times):]), flush=True)

    def run(op, shape, impls, flops, *args, tol=2e-2, dtype="bfloat16", **kw):
        impls = checked(impls, *args, tol=tol)
        record(op, shape, {name: time_ms(lambda f=f: f(*args), **{**timing, **kw})
                           for name, f in impls.items()}, flops, dtype=dtype)

    for shape in shapes("all_gather_matmul", AG_SHAPES, 1, SMOKE["ag"]):
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P("x"), rng), _put(mesh, (k, nn), P(None, "x"), rng, k ** -0.5)
        run("all_gather_matmul", shape,
            {**ag_impls(mesh), **windowed(mesh, jnp.matmul, P(None, "x"), x, w)},
            2.0 * m * k * nn, x, w)
    for shape in shapes("matmul_reduce_scatter", RS_SHAPES, 1, SMOKE["rs"]):
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P(None, "x"), rng), _put(mesh, (k, nn), P("x"), rng, k ** -0.5)
        run("matmul_reduce_scatter", shape,
            {**rs_impls(mesh), **windowed(mesh, jnp.matmul, P("x"), x, w)},
            2.0 * m * k * nn, x, w)
    for shape in shapes("matmul_all_reduce", AR_SHAPES, 2, SMOKE["ar"]):
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P(None, "x"), rng), _put(mesh, (k, nn), P("x"), rng, k ** -0.5)
        run("matmul_all_reduce", shape,
            {**ar_impls(mesh), **windowed(mesh, jnp.matmul, P(), x, w)},
            2.0 * m * k * nn, x, w)
    for shape in shapes("gemm_world_size_1", WS1_SHAPES, 1, SMOKE["ws1"]):
        # World size 1: pk's GEMM (no peers; "chunked" forces it: `auto` runs
        # XLA's dot on one device) against XLA's dot on one GPU, in
        # interleaved rounds (clocks drift under sustained load).
        m, k, nn = shape
        one = one_axis_mesh(devices[:1])
        x, w = _put(one, (m, k), P("x"), rng), _put(one, (k, nn), P(None, "x"), rng, k ** -0.5)
        impls = ag_impls(one, "chunked")
        runs = interleaved_ms({name: (lambda f=impls[name]: f(x, w)) for name in ("pk", "xla")},
                              **(dict(rounds=1, calls=2, batches=1) if args.smoke else {}))
        times = {name: float(np.median(t)) for name, t in runs.items()}
        record("gemm_world_size_1", shape, times, 2.0 * m * k * nn, gpus=1)
    for tokens, d, ffn in shapes("mlp_fwd_bwd", [(8192, 8192, 28672)], 1, SMOKE["mlp"]):
        # MLP pair, forward + backward (hidden 8192, ffn 28672, 8192 tokens).
        x = _put(mesh, (tokens, d), P("x"), rng)
        w1 = _put(mesh, (d, ffn), P(None, "x"), rng, d ** -0.5)
        w2 = _put(mesh, (ffn, d), P("x", None), rng, ffn ** -0.5)
        impls = mlp_impls(mesh)
        if devices[0].platform == "gpu":  # the fused backward, not a fallback (CPU: XLA's)
            text = impls["pk"].lower(x, w1, w2).as_text()
            assert "@pk_all_gather_matmul_bwd(" in text
            assert "@pk_matmul_reduce_scatter_bwd(" in text
        run("mlp_fwd_bwd", (tokens, d, ffn),
            {**impls, **windowed(mesh, mlp_global(mesh), None, x, w1, w2)},
            3 * 2 * 2.0 * tokens * d * ffn, x, w1, w2, calls=2 if args.smoke else 5)
    for op, full, spec_x, spec_w, smoke in (
            ("fp8_all_gather_matmul", AG_SHAPES, P("x"), P(None, "x"), SMOKE["fp8_ag"]),
            ("fp8_matmul_reduce_scatter", RS_SHAPES, P(None, "x"), P("x"), SMOKE["fp8_rs"])):
        for shape in shapes(op, full, 1, smoke):
            m, k, nn = shape
            x, w = _put(mesh, (m, k), spec_x, rng), _put(mesh, (k, nn), spec_w, rng, k ** -0.5)
            run(op, shape, fp8_impls(mesh, op), 2.0 * m * k * nn, x, w, tol=FP8_TOL,
                dtype="float8_e4m3fn (bf16 in, quantized in the call)")
    for shape in shapes("fp8_gemm_world_size_1", WS1_SHAPES, 1, SMOKE["fp8_ws1"]):
        # World size 1, FP8: pk's TP ops with fp8=recipe (their sequences on
        # one rank) against the same recipe's pk_jax.fp8_dot (quantization and
        # the FP8 GEMM alone: the "gemm_only" floor) and XLA's FP8 dots, in
        # interleaved rounds; one record per recipe.
        m, k, nn = shape
        one = one_axis_mesh(devices[:1])
        x, w = _put(one, (m, k), P("x"), rng), _put(one, (k, nn), P(None, "x"), rng, k ** -0.5)
        impls = fp8_ws1_impls(one)
        impls = checked({**impls, "xla": ag_impls(one)["xla"]}, x, w, tol=FP8_TOL)
        runs = interleaved_ms({name: (lambda f=f: f(x, w)) for name, f in impls.items()
                               if name != "xla"},  # the bf16 reference of the check only
                              **(dict(rounds=1, calls=2, batches=1) if args.smoke else {}))
        times = {name: float(np.median(t)) for name, t in runs.items()}
        for recipe in ("current", "block"):
            picked = {name: ms for name, ms in times.items()
                      if name.endswith(recipe) or name in XLA_FP8_DOTS}
            picked["gemm_only"] = picked.pop(f"fp8_dot_{recipe}")
            record("fp8_gemm_world_size_1", shape, picked, 2.0 * m * k * nn, gpus=1,
                   dtype=f"float8_e4m3fn ({recipe}, bf16 in)")
    if args.smoke:
        print("SMOKE_OK (nothing written)")
    return _finish(rows, table, write=only == set(OPS) and not args.smoke)


def _finish(rows, table, write: bool) -> int:
    md = ("Columns: time per call (ms), TFLOP/s per GPU, time over gemm-only (the same local "
          "GEMM with no communication), the fastest XLA row (xla: the collective and the dot in "
          "shard_map; xla_windowed: XLA's collective matmul, the global-view program compiled "
          f"with {WINDOWED_OPTIONS}; fp8_* ops: xla_fp8_*, XLA's FP8 dot written three ways "
          "after an FP8 gather or before a bf16 reduce-scatter) and the speedup over it. "
          "mlp_fwd_bwd: column- then row-parallel layer, loss and gradients, 3x the forward "
          "FLOPs. fp8_*: the forwards on bf16 operands quantized in the call (pk_fp8_current: "
          "per-tensor factors, pk_fp8_block: DeepSeek-V3's blocks). fp8_gemm_world_size_1: "
          "one GPU, pk_ag_* / pk_rs_* are all_gather_matmul / matmul_reduce_scatter with "
          "fp8=recipe, and gemm_only is that recipe's pk_jax.fp8_dot (the same quantization "
          "and FP8 GEMM without the op around them).\n\n"
          + markdown_table(HEADER, table))
    if write:
        write_results("tp_matmul", rows, md,
                      "python benchmarks/tp_matmul.py " + " ".join(sys.argv[1:]))
    else:  # a partial run would replace the full run's results: table only
        print("--only / --smoke: results/tp_matmul.json and RESULTS.md left as they are")
    print(md)
    pk_jax.check_errors()
    return 0


HEADER = ["op", "M x K x N", "impl", "ms", "TFLOP/s/GPU", "vs gemm-only", "best xla",
          "vs best xla"]

if __name__ == "__main__":
    raise SystemExit(main())
