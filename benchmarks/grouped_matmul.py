"""pk_jax.grouped_matmul (the grouped-GEMM kernel) on one GPU against the two
grouped GEMMs a JAX user has, same run, interleaved rounds:

  * "xla": jax.lax.ragged_dot as XLA compiles it (the default);
  * "mgpu": jax.experimental.pallas.ops.gpu's Hopper kernels (ragged_dot_mgpu
    for the forward and dX, transposed_ragged_dot_mgpu for dW, joined by a
    custom_vjp as a user would), the best of a few tile configurations per
    shape, picked by timing in this run. Where Mosaic GPU is missing or
    refuses a shape, the row is left out and the reason printed.

Passes: "fwd" (the forward) and "fwd+bwd" (value_and_grad with respect to
both operands: the forward and both gradient GEMMs, nothing dead-code
eliminated). Shapes: an MoE layer's expert GEMMs on one rank (rows = tokens x
top-k routed to its experts, uniform random group sizes summing to the rows).

Usage: python benchmarks/grouped_matmul.py [--save] [--no-mgpu]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from common import interleaved_ms, markdown_table, time_ms, write_results

# (rows, K, N, groups): DeepSeek-V3-like hidden 7168 / expert ffn 2048, and
# hidden 4096 / ffn 1408, with 8 and 32 local experts.
SHAPES = [(16384, 7168, 2048, 8), (16384, 2048, 7168, 8), (8192, 4096, 1408, 32),
          (8192, 1408, 4096, 32)]
HEADER = ["rows x K x N", "groups", "pass", "impl", "ms", "TFLOP/s", "vs xla", "vs mgpu"]
# Tile configurations tried for each Mosaic GPU kernel (block_m, block_n,
# block_k, max_concurrent_steps, grid_block_n).
MGPU_CONFIGS = list(itertools.product((128,), (128, 256), (64,), (4,), (1, 4)))


def _sizes(rng, rows, groups):
    cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
    return np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int32)


def _best(name, make, args):
    """The fastest of make(config) over MGPU_CONFIGS that compiles."""
    best, best_ms, why = None, float("inf"), "no configuration compiled"
    for cfg in MGPU_CONFIGS:
        kw = dict(zip(("block_m", "block_n", "block_k", "max_concurrent_steps",
                       "grid_block_n"), cfg))
        try:
            f = jax.jit(make(kw))
            ms = time_ms(lambda: f(*args), calls=5, batches=3)
        except Exception as e:  # noqa: BLE001: a config Mosaic GPU refuses
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
        if ms < best_ms:
            best, best_ms = kw, ms
    if best is None:
        raise RuntimeError(f"{name}: {why}")
    print(f"mgpu {name}: best {best} {best_ms:.3f} ms", flush=True)
    return best


def mgpu_grouped_matmul(x, w, s):
    """ragged_dot(x, w, s) with gradients through jax.experimental's Mosaic
    GPU kernels, each tuned on these operands."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
    g = jnp.ones((x.shape[0], w.shape[2]), x.dtype)
    fwd_kw = _best("fwd", lambda kw: lambda x, w: rd.ragged_dot(x, w, group_sizes=s, **kw),
                   (x, w))
    dx_kw = _best("dx", lambda kw: lambda g, w: rd.ragged_dot(
        g, w, group_sizes=s, transpose_rhs=True, **kw), (g, w))
    dw_kw = _best("dw", lambda kw: lambda x, g: trd.transposed_ragged_dot(
        x, g, group_sizes=s, **kw), (x, g))

    @jax.custom_vjp
    def f(x, w):
        return rd.ragged_dot(x, w, group_sizes=s, **fwd_kw)

    def f_bwd(res, g):
        x, w = res
        return (rd.ragged_dot(g, w, group_sizes=s, transpose_rhs=True, **dx_kw),
                trd.transposed_ragged_dot(x, g, group_sizes=s, **dw_kw))

    f.defvjp(lambda x, w: (f(x, w), (x, w)), f_bwd)
    return f


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true", help="write results/grouped_matmul.json")
    ap.add_argument("--no-mgpu", action="store_true", help="leave out the Mosaic GPU rows")
    args = ap.parse_args()
    rng = np.random.default_rng()
    rows, table = [], []
    for m, k, n, g in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        s = jnp.asarray(_sizes(rng, m, g))
        impls = {"pk": functools.partial(pk_jax.grouped_matmul, group_sizes=s,
                                         mechanism="kernel"),
                 "xla": functools.partial(jax.lax.ragged_dot, group_sizes=s)}
        if not args.no_mgpu and jax.devices()[0].platform == "gpu":
            try:
                impls["mgpu"] = mgpu_grouped_matmul(x, w, s)
            except Exception as e:  # noqa: BLE001: reported, row left out
                print(f"mgpu left out at {m}x{k}x{n}/{g}: {e}", flush=True)
        want = np.asarray(impls["xla"](x, w), np.float32)
        for impl, f in impls.items():
            err = float(np.abs(np.asarray(jax.jit(f)(x, w), np.float32) - want).max())
            assert err <= 2e-2 * float(np.abs(want).max()), (impl, err)
        for pass_, flops in (("fwd", 2.0 * m * k * n), ("fwd+bwd", 6.0 * m * k * n)):
            fns = {}
            for impl, f in impls.items():
                if pass_ == "fwd+bwd":
                    f = jax.value_and_grad(
                        lambda x, w, f=f: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1))
                fns[impl] = jax.jit(f)
            runs = interleaved_ms({impl: (lambda f=f: f(x, w)) for impl, f in fns.items()})
            times = {impl: float(np.median(t)) for impl, t in runs.items()}
            for impl, ms in times.items():
                rows.append({"op": "grouped_matmul", "shape": [m, k, n], "groups": g,
                             "pass": pass_, "dtype": "bfloat16", "implementation": impl,
                             "median_ms": ms, "baseline": "xla_ragged_dot",
                             "baseline_median_ms": times["xla"],
                             "mgpu_median_ms": times.get("mgpu")})
                vs_mgpu = f"{times['mgpu'] / ms:.2f}x" if "mgpu" in times else "-"
                table.append([f"{m}x{k}x{n}", g, pass_, impl, f"{ms:.3f}",
                              f"{flops / (ms * 1e-3) / 1e12:.0f}", f"{times['xla'] / ms:.2f}x",
                              vs_mgpu])
            print(markdown_table(HEADER, table[-len(times):]), flush=True)
    md = markdown_table(HEADER, table)
    if args.save:
        write_results("grouped_matmul", rows, md,
                      "python benchmarks/grouped_matmul.py --save")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
