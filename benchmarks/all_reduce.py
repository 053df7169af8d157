"""pk_jax.all_reduce against lax.psum (NCCL), same run.

Two measurements per per-rank size (bf16, the sum of every rank's block):
  * bandwidth: one jitted all_reduce per call, host-timed batches; bus
    bandwidth = 2 (n - 1) / n * per_rank_bytes / time (NCCL's convention:
    the bytes each link carries in a ring all-reduce).
  * latency: `--loop` dependent all_reduces inside one program (a fori_loop,
    10 calls per iteration), time per call. The "no_comm" row is the same
    program with a local scale instead: what the loop itself costs.

Needs 2+ GPUs for meaningful numbers (with one device every mechanism is a
local copy). `--smoke` runs two tiny sizes without writing results (works on
CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2).

Usage: python benchmarks/all_reduce.py [--sizes 8K,1M,...] [--loop 200] [--smoke]
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
from common import bench_setup, markdown_table, time_ms, write_results

IMPLS = {
    # No communication: the cost of the loop, add and scale alone (the floor).
    "no_comm": lambda a: a * jnp.asarray(lax.axis_size("x"), a.dtype),
    "xla": lambda a: lax.psum(a, "x"),
    "pk_ld_st_oneshot": lambda a: pk_jax.all_reduce(a, "x", mechanism="ld_st_oneshot"),
    "pk_two_shot": lambda a: pk_jax.all_reduce(a, "x", mechanism="two_shot"),
    "pk_copy_engine": lambda a: pk_jax.all_reduce(a, "x", mechanism="copy_engine"),
}

HEADER = ["per rank", "impl", "ms/call", "bus GB/s", "vs xla", "us/call in program",
          "vs xla"]
UNROLL = 10  # dependent calls per loop iteration: amortizes the loop's own cost


def result_row(name, n, elems, per_rank, bw_ms, lat_us) -> dict:
    """One implementation at one size, as written to results/all_reduce.json."""
    return {"shape": [elems], "dtype": "bfloat16", "per_rank_bytes": per_rank,
            "implementation": name, "median_ms": bw_ms[name], "baseline": "xla",
            "baseline_median_ms": bw_ms["xla"],
            "bus_GBps": 2 * (n - 1) / n * per_rank / (bw_ms[name] * 1e-3) / 1e9,
            "loop_latency_us": lat_us.get(name), "baseline_loop_latency_us": lat_us.get("xla")}


def table_row(r: dict) -> list:
    ratio = lambda base, ours: "-" if r["implementation"] == "no_comm" or ours is None \
        else f"{base / ours:.2f}x"
    lat = r["loop_latency_us"]
    return [f"{r['per_rank_bytes'] >> 10} KiB", r["implementation"], f"{r['median_ms']:.4f}",
            "-" if r["implementation"] == "no_comm" else f"{r['bus_GBps']:.1f}",
            ratio(r["baseline_median_ms"], r["median_ms"]),
            "-" if lat is None else f"{lat:.1f}",
            ratio(r["baseline_loop_latency_us"], lat)]


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def bandwidth_fn(mesh, reduce):
    return jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def latency_fn(mesh, reduce, calls):
    """`calls` dependent all_reduces in one program: a fori_loop whose body
    runs UNROLL of them, each feeding the next (scaled back by 1/n, so the
    values stay finite)."""
    def body(i, c):
        for _ in range(UNROLL):
            c = reduce(c) * jnp.bfloat16(0.5) + jnp.bfloat16(1)
        return c
    return jax.jit(jax.shard_map(lambda c: lax.fori_loop(0, calls // UNROLL, body, c),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8K,64K,256K,1M,16M,64M,256M")
    ap.add_argument("--loop", type=int, default=200, help="calls in the latency program")
    ap.add_argument("--latency-max", default="16M", help="largest size timed in the loop")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, few calls, nothing written (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.loop = "8K,1M", 20

    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    for per_rank in map(parse_size, args.sizes.split(",")):
        elems = per_rank // 2
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * elems, dtype=np.float32),
                                       jnp.bfloat16), NamedSharding(mesh, P("x")))
        bw_ms, lat_us = {}, {}
        timing = dict(calls=2, batches=2, warmup=1) if args.smoke else {}
        for name, reduce in IMPLS.items():
            f = bandwidth_fn(mesh, reduce)
            bw_ms[name] = time_ms(lambda: f(x), **timing)
            if per_rank <= parse_size(args.latency_max):
                g = latency_fn(mesh, reduce, args.loop)
                lat_us[name] = time_ms(lambda: g(x), calls=3 if not args.smoke else 1,
                                       batches=3 if not args.smoke else 1) * 1e3 / args.loop
        for name in IMPLS:
            rows.append(result_row(name, n, elems, per_rank, bw_ms, lat_us))
            table.append(table_row(rows[-1]))
        print(markdown_table(HEADER, table[-len(IMPLS):]), flush=True)
    md = (f"Columns: one jitted call timed from the host (launch overhead included, so small "
          f"sizes show dispatch, not transfer); bus bandwidth of that call (2 (n - 1) / n x "
          f"bytes per rank / time); the same as a ratio to XLA's psum; then latency per call "
          f"inside one program of {args.loop} dependent calls and its ratio to XLA. `no_comm` "
          f"is that program with a local scale instead of the all-reduce: the floor the loop "
          f"itself sets. `auto` (pk_jax/tuning.py) is provisional until these rows exist for "
          f"2 GPUs.\n\n" + markdown_table(HEADER, table))
    if args.smoke:
        print("SMOKE_OK (nothing written)")
    else:
        write_results("all_reduce", rows, md,
                      "python benchmarks/all_reduce.py " + " ".join(sys.argv[1:]))
        print(md)
    pk_jax.check_errors()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
