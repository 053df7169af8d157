"""Tensor-parallel matmuls: pk_jax against XLA (all_gather + dot, dot +
psum_scatter, dot + psum) and against gemm-only (the same local GEMM with no
communication: the floor perfect overlap reaches), in one run.

Usage: python benchmarks/tp_matmul.py [--quick] [--only OP[,OP...]]
"""

from __future__ import annotations

import argparse
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
       "mlp_fwd_bwd")


def _put(mesh, shape, spec, rng, scale=1.0):
    a = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, jnp.bfloat16)
    return jax.device_put(a, NamedSharding(mesh, spec))


def ag_impls(mesh):
    specs = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
    return {
        "pk": jax.jit(jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "x"), **specs)),
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first shape of each op only")
    ap.add_argument("--only", default=",".join(OPS),
                    help=f"comma-separated subset of {', '.join(OPS)}")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(OPS):
        ap.error(f"--only: unknown {sorted(only - set(OPS))}; choose from {OPS}")
    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    # Each op's channel stages its largest shape in a power-of-two region
    # (pk_jax/_channels.py): this sweep's regions add up to ~1 GiB.
    pk_jax.configure(workspace_bytes=3 << 30)

    def record(op, shape, times, flops, gpus=n):
        base, floor = times["xla"], times.get("gemm_only")
        for name, ms in times.items():
            rows.append({"op": op, "shape": list(shape), "dtype": "bfloat16",
                         "implementation": name, "median_ms": ms, "baseline": "xla",
                         "baseline_median_ms": base, "gemm_only_ms": floor,
                         "tflops_per_gpu": flops / gpus / (ms * 1e-3) / 1e12})
            table.append([op, "x".join(map(str, shape)), name, f"{ms:.3f}",
                          f"{flops / gpus / (ms * 1e-3) / 1e12:.0f}",
                          f"{ms / floor:.3f}" if floor else "-", f"{base / ms:.2f}x"])
        print(markdown_table(HEADER, table[-len(times):]), flush=True)

    for shape in AG_SHAPES[: 0 if "all_gather_matmul" not in only else 1 if args.quick else None]:
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P("x"), rng), _put(mesh, (k, nn), P(None, "x"), rng, k ** -0.5)
        times = {name: time_ms(lambda: f(x, w)) for name, f in ag_impls(mesh).items()}
        record("all_gather_matmul", shape, times, 2.0 * m * k * nn)
    for shape in RS_SHAPES[: 0 if "matmul_reduce_scatter" not in only
                           else 1 if args.quick else None]:
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P(None, "x"), rng), _put(mesh, (k, nn), P("x"), rng, k ** -0.5)
        times = {name: time_ms(lambda: f(x, w)) for name, f in rs_impls(mesh).items()}
        record("matmul_reduce_scatter", shape, times, 2.0 * m * k * nn)
    for shape in AR_SHAPES[: 0 if "matmul_all_reduce" not in only else 2 if args.quick else None]:
        m, k, nn = shape
        x, w = _put(mesh, (m, k), P(None, "x"), rng), _put(mesh, (k, nn), P("x"), rng, k ** -0.5)
        times = {name: time_ms(lambda: f(x, w)) for name, f in ar_impls(mesh).items()}
        record("matmul_all_reduce", shape, times, 2.0 * m * k * nn)
    for shape in WS1_SHAPES[: 0 if "gemm_world_size_1" not in only else 1 if args.quick else None]:
        # World size 1: pk's GEMM (no peers) against XLA's dot on one GPU, in
        # interleaved rounds (clocks drift under sustained load).
        m, k, nn = shape
        one = one_axis_mesh(devices[:1])
        x, w = _put(one, (m, k), P("x"), rng), _put(one, (k, nn), P(None, "x"), rng, k ** -0.5)
        impls = ag_impls(one)
        runs = interleaved_ms({name: (lambda f=impls[name]: f(x, w)) for name in ("pk", "xla")})
        times = {name: float(np.median(t)) for name, t in runs.items()}
        record("gemm_world_size_1", shape, times, 2.0 * m * k * nn, gpus=1)
    if "mlp_fwd_bwd" in only:
        # MLP pair, forward + backward, hidden 8192 (ffn 28672), 8192 tokens.
        tokens, d, ffn = 8192, 8192, 28672
        x = _put(mesh, (tokens, d), P("x"), rng)
        w1 = _put(mesh, (d, ffn), P(None, "x"), rng, d ** -0.5)
        w2 = _put(mesh, (ffn, d), P("x"), rng, ffn ** -0.5)
        impls = mlp_impls(mesh)
        text = impls["pk"].lower(x, w1, w2).as_text()  # the fused backward, not a fallback
        assert "@pk_all_gather_matmul_bwd(" in text and "@pk_matmul_reduce_scatter_bwd(" in text
        times = {name: time_ms(lambda: f(x, w1, w2), calls=5) for name, f in impls.items()}
        record("mlp_fwd_bwd", (tokens, d, ffn), times, 3 * 2 * 2.0 * tokens * d * ffn)
    return _finish(rows, table, write=only == set(OPS))


def _finish(rows, table, write: bool) -> int:
    md = ("Columns: time per call (ms), TFLOP/s per GPU, time over gemm-only (the same local "
          "GEMM with no communication), speedup over XLA. mlp_fwd_bwd: column- then "
          "row-parallel layer, loss and gradients, 3x the forward FLOPs.\n\n"
          + markdown_table(HEADER, table))
    if write:
        write_results("tp_matmul", rows, md,
                      "python benchmarks/tp_matmul.py " + " ".join(sys.argv[1:]))
    else:  # a partial run would replace the full run's results: table only
        print("--only: results/tp_matmul.json and RESULTS.md left as they are")
    print(md)
    pk_jax.check_errors()
    return 0


HEADER = ["op", "M x K x N", "impl", "ms", "TFLOP/s/GPU", "vs gemm-only", "vs xla"]

if __name__ == "__main__":
    raise SystemExit(main())
