"""pk_jax.all_gather against lax.all_gather (NCCL), same run.

Two measurements per per-rank size:
  * bandwidth: one jitted all_gather per call, host-timed batches;
    bus bandwidth = (n - 1) / n * n * per_rank_bytes / time.
  * latency: `--loop` dependent all_gathers inside one program (a fori_loop,
    10 calls per iteration), time per call. The "no_comm" row is the same
    program with a local concatenate instead: what the loop itself costs.

Usage: python benchmarks/all_gather.py [--sizes 8K,1M,...] [--loop 200]
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
    # No communication: the cost of the loop, slice and add alone (the floor).
    "no_comm": lambda a: jnp.concatenate([a] * lax.axis_size("x")),
    "xla": lambda a: lax.all_gather(a, "x", tiled=True),
    "pk_ld_st_ll": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_ll"),
    "pk_ld_st_push": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_push"),
    "pk_ld_st_pull": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_pull"),
    "pk_copy_engine": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="copy_engine"),
}


HEADER = ["per rank", "impl", "ms/call", "bus GB/s", "vs xla", "us/call in program",
          "vs xla"]


def result_row(name, n, elems, per_rank, bw_ms, lat_us) -> dict:
    """One implementation at one size, as written to results/all_gather.json."""
    return {"shape": [n * elems], "dtype": "bfloat16", "per_rank_bytes": per_rank,
            "implementation": name, "median_ms": bw_ms[name], "baseline": "xla",
            "baseline_median_ms": bw_ms["xla"],
            "bus_GBps": (n - 1) * per_rank / (bw_ms[name] * 1e-3) / 1e9,
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


def bandwidth_fn(mesh, gather):
    return jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


LL_MAX = 16 << 10  # largest per-rank message of the ld_st_ll mechanism
UNROLL = 10  # dependent calls per loop iteration: amortizes the loop's own cost


def latency_fn(mesh, gather, calls):
    """`calls` dependent all_gathers in one program: a fori_loop whose body
    runs UNROLL of them, each feeding the next."""
    def body(i, c):
        for _ in range(UNROLL):
            c = lax.dynamic_slice_in_dim(gather(c), 0, c.shape[0]) + jnp.bfloat16(1)
        return c
    return jax.jit(jax.shard_map(lambda c: lax.fori_loop(0, calls // UNROLL, body, c),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8K,16K,64K,1M,16M,64M,256M")
    ap.add_argument("--loop", type=int, default=200, help="calls in the latency program")
    ap.add_argument("--latency-max", default="16M", help="largest size timed in the loop")
    ap.add_argument("--sweep-blocks", default="", help="e.g. 32,66,132,264: grid sweep at the largest size")
    args = ap.parse_args()

    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    for per_rank in map(parse_size, args.sizes.split(",")):
        elems = per_rank // 2
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * elems, dtype=np.float32),
                                       jnp.bfloat16), NamedSharding(mesh, P("x")))
        bw_ms, lat_us = {}, {}
        impls = {k: v for k, v in IMPLS.items() if k != "pk_ld_st_ll" or per_rank <= LL_MAX}
        for name, gather in impls.items():
            f = bandwidth_fn(mesh, gather)
            bw_ms[name] = time_ms(lambda: f(x))
            if per_rank <= parse_size(args.latency_max):
                g = latency_fn(mesh, gather, args.loop)
                lat_us[name] = time_ms(lambda: g(x), calls=3, batches=3) * 1e3 / args.loop
        for name in impls:
            rows.append(result_row(name, n, elems, per_rank, bw_ms, lat_us))
            table.append(table_row(rows[-1]))
        print(markdown_table(HEADER, table[-len(impls):]), flush=True)
    if args.sweep_blocks:
        # Grid size of the push kernel at the largest size: how many SMs the
        # NVLink traffic needs (512-thread blocks, 2 co-resident per SM).
        elems = parse_size(args.sizes.split(",")[-1]) // 2
        x = jax.device_put(jnp.asarray(rng.standard_normal(n * elems, dtype=np.float32),
                                       jnp.bfloat16), NamedSharding(mesh, P("x")))
        for mech in ("ld_st_push", "ld_st_pull"):
            for blocks in map(int, args.sweep_blocks.split(",")):
                f = bandwidth_fn(mesh, lambda a: pk_jax.all_gather(
                    a, "x", tiled=True, mechanism=mech, num_blocks=blocks))
                ms = time_ms(lambda: f(x))
                print(f"sweep {mech} num_blocks={blocks}: {ms:.4f} ms, "
                      f"{(n - 1) * elems * 2 / (ms * 1e-3) / 1e9:.1f} GB/s", flush=True)
    md = (f"Columns: one jitted call timed from the host (launch overhead included, so small "
          f"sizes show dispatch, not transfer); bus bandwidth of that call; the same as a "
          f"ratio to XLA; then latency per call inside one program of {args.loop} dependent "
          f"calls and its ratio to XLA. `no_comm` is that program with a local concatenate "
          f"instead of the gather: the floor the loop itself sets.\n\n"
          + markdown_table(HEADER, table))
    write_results("all_gather", rows, md, "python benchmarks/all_gather.py " + " ".join(sys.argv[1:]))
    print(md)
    pk_jax.check_errors()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
