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

import jax.numpy as jnp
from jax import lax

import pk_jax
from common import (COLLECTIVE_HEADER, bench_setup, collective_args, collective_row,
                    collective_table_row, finish_collective, markdown_table, parse_size,
                    size_inputs, time_collective)

IMPLS = {
    # No communication: the cost of the loop, add and scale alone (the floor).
    "no_comm": lambda a: a * jnp.asarray(lax.axis_size("x"), a.dtype),
    "xla": lambda a: lax.psum(a, "x"),
    "pk_one_shot": lambda a: pk_jax.all_reduce(a, "x", mechanism="one_shot"),
    "pk_two_shot": lambda a: pk_jax.all_reduce(a, "x", mechanism="two_shot"),
    "pk_copy_engine": lambda a: pk_jax.all_reduce(a, "x", mechanism="copy_engine"),
}


def step(reduce, c):
    """One call of the latency program: the sum, scaled back (values stay finite)."""
    return reduce(c) * jnp.bfloat16(0.5) + jnp.bfloat16(1)


def main() -> int:
    args = collective_args("8K,64K,256K,1M,16M,64M,256M")

    devices, mesh, rng = bench_setup()
    n = len(devices)
    rows, table = [], []
    for per_rank, elems, x in size_inputs(args, mesh, rng):
        bw_ms, lat_us = time_collective(mesh, IMPLS, step, x, loop=args.loop,
                                        latency=per_rank <= parse_size(args.latency_max),
                                        smoke=args.smoke)
        for name in IMPLS:
            # NCCL's convention: the bytes each link carries in a ring all-reduce.
            rows.append(collective_row(name, [elems], per_rank, 2 * (n - 1) / n * per_rank,
                                       bw_ms, lat_us))
            table.append(collective_table_row(rows[-1]))
        print(markdown_table(COLLECTIVE_HEADER, table[-len(IMPLS):]), flush=True)
    md = (f"Columns: one jitted call timed from the host (launch overhead included, so small "
          f"sizes show dispatch, not transfer); bus bandwidth of that call (2 (n - 1) / n x "
          f"bytes per rank / time); the same as a ratio to XLA's psum; then latency per call "
          f"inside one program of {args.loop} dependent calls and its ratio to XLA. `no_comm` "
          f"is that program with a local scale instead of the all-reduce: the floor the loop "
          f"itself sets. `auto` (pk_jax/tuning.py) is provisional until these rows exist for "
          f"2 GPUs.\n\n" + markdown_table(COLLECTIVE_HEADER, table))
    finish_collective("all_reduce", rows, md, args.smoke)
    pk_jax.check_errors()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
