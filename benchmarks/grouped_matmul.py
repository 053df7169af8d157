"""pk_jax.grouped_matmul (the grouped-GEMM kernel) against XLA's
jax.lax.ragged_dot on one GPU, forward and forward + backward, same run,
interleaved rounds. Shapes: an MoE layer's expert GEMMs on one rank (rows =
tokens x top-k routed to its experts, uniform random group sizes summing to
the rows).

Usage: python benchmarks/grouped_matmul.py [--save]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from common import interleaved_ms, markdown_table, write_results

# (rows, K, N, groups): DeepSeek-V3-like hidden 7168 / expert ffn 2048, and
# hidden 4096 / ffn 1408, with 8 and 32 local experts.
SHAPES = [(16384, 7168, 2048, 8), (16384, 2048, 7168, 8), (8192, 4096, 1408, 32),
          (8192, 1408, 4096, 32)]
HEADER = ["rows x K x N", "groups", "pass", "impl", "ms", "TFLOP/s", "vs xla"]


def _sizes(rng, rows, groups):
    cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
    return np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true", help="write results/grouped_matmul.json")
    args = ap.parse_args()
    rng = np.random.default_rng()
    rows, table = [], []
    for m, k, n, g in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        s = jnp.asarray(_sizes(rng, m, g))
        for pass_, flops in (("fwd", 2.0 * m * k * n), ("fwd+bwd", 6.0 * m * k * n)):
            fns = {}
            for impl, mech in (("pk", "kernel"), ("xla", "xla")):
                f = lambda x, w, mech=mech: pk_jax.grouped_matmul(x, w, s, mechanism=mech)
                if pass_ == "fwd+bwd":
                    f = jax.grad(lambda x, w, f=f: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1))
                fns[impl] = jax.jit(f)
            runs = interleaved_ms({impl: (lambda f=f: f(x, w)) for impl, f in fns.items()})
            times = {impl: float(np.median(t)) for impl, t in runs.items()}
            for impl, ms in times.items():
                rows.append({"op": "grouped_matmul", "shape": [m, k, n], "groups": g,
                             "pass": pass_, "dtype": "bfloat16", "implementation": impl,
                             "median_ms": ms, "baseline": "xla_ragged_dot",
                             "baseline_median_ms": times["xla"]})
                table.append([f"{m}x{k}x{n}", g, pass_, impl, f"{ms:.3f}",
                              f"{flops / (ms * 1e-3) / 1e12:.0f}", f"{times['xla'] / ms:.2f}x"])
            print(markdown_table(HEADER, table[-2:]), flush=True)
    md = markdown_table(HEADER, table)
    if args.save:
        write_results("grouped_matmul", rows, md, "python benchmarks/grouped_matmul.py --save")
    else:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
