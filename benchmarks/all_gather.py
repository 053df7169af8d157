"""pk_jax.all_gather against lax.all_gather (NCCL), same run.

Two measurements per per-rank size:
  * bandwidth: one jitted all_gather per call, host-timed batches;
    bus bandwidth = (n - 1) / n * n * per_rank_bytes / time.
  * latency: `--loop` dependent all_gathers inside one program (a fori_loop,
    10 calls per iteration), time per call. The "no_comm" row is the same
    program with a local concatenate instead: what the loop itself costs.

`--smoke` runs two tiny sizes without writing results (works on CPU:
XLA_FLAGS=--xla_force_host_platform_device_count=2).

Usage: python benchmarks/all_gather.py [--sizes 8K,1M,...] [--loop 200] [--smoke]
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import pk_jax
from common import (COLLECTIVE_HEADER, bandwidth_fn, bench_setup, bf16_input, collective_args,
                    collective_row, collective_table_row, finish_collective, markdown_table,
                    parse_size, size_inputs, time_collective, time_ms)

IMPLS = {
    # No communication: the cost of the loop, slice and add alone (the floor).
    "no_comm": lambda a: jnp.concatenate([a] * lax.axis_size("x")),
    "xla": lambda a: lax.all_gather(a, "x", tiled=True),
    "pk_ld_st_ll": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_ll"),
    "pk_ld_st_push": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_push"),
    "pk_ld_st_pull": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="ld_st_pull"),
    "pk_copy_engine": lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="copy_engine"),
}

LL_MAX = 16 << 10  # largest per-rank message of the ld_st_ll mechanism


def step(gather, c):
    """One call of the latency program: the gather, sliced back to one block."""
    return lax.dynamic_slice_in_dim(gather(c), 0, c.shape[0]) + jnp.bfloat16(1)


def main() -> int:
    args = collective_args("8K,16K,64K,1M,16M,64M,256M", lambda ap: ap.add_argument(
        "--sweep-blocks", default="", help="e.g. 32,66,132,264: grid sweep at the largest size"))

    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    for per_rank, elems, x in size_inputs(args, mesh, rng):
        impls = {k: v for k, v in IMPLS.items() if k != "pk_ld_st_ll" or per_rank <= LL_MAX}
        bw_ms, lat_us = time_collective(mesh, impls, step, x, loop=args.loop,
                                        latency=per_rank <= parse_size(args.latency_max),
                                        smoke=args.smoke)
        for name in impls:
            rows.append(collective_row(name, [n * elems], per_rank, (n - 1) * per_rank,
                                       bw_ms, lat_us))
            table.append(collective_table_row(rows[-1]))
        print(markdown_table(COLLECTIVE_HEADER, table[-len(impls):]), flush=True)
    if args.sweep_blocks:
        # Grid size of the push kernel at the largest size: how many SMs the
        # NVLink traffic needs (512-thread blocks, 2 co-resident per SM).
        elems = parse_size(args.sizes.split(",")[-1]) // 2
        x = bf16_input(mesh, rng, elems)
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
          + markdown_table(COLLECTIVE_HEADER, table))
    finish_collective("all_gather", rows, md, args.smoke)
    pk_jax.check_errors()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
