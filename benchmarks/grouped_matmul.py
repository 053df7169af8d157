"""pk_jax.grouped_matmul (the grouped-GEMM kernel) on one GPU against the
grouped GEMMs a JAX user has, same run, interleaved rounds. The ratio to
lead with is against the best Mosaic GPU kernel of the run:

  * "tokamax": tokamax's `ragged_dot(implementation="mosaic")` (its own
    configuration choice and gradients), where tokamax is installed;
  * "mgpu": jax.experimental.pallas.ops.gpu's Hopper kernels (ragged_dot_mgpu
    for the forward and dX, transposed_ragged_dot_mgpu for dW, joined by a
    custom_vjp as a user would), the best of a few tile configurations per
    kernel and shape, picked by timing in this run;
  * "xla": jax.lax.ragged_dot as XLA compiles it (every group computed
    densely: not the baseline to beat, shown for reference).

Where a Mosaic kernel is missing or refuses a shape (or there is no GPU),
its row is left out and the reason printed. Passes: "fwd" (the forward) and
"fwd+bwd" (value_and_grad with respect to both operands: the forward and
both gradient GEMMs, nothing dead-code eliminated). Shapes: an MoE layer's
expert GEMMs on one rank (rows = tokens x top-k routed to its experts,
uniform random group sizes summing to the rows). Every output is checked
against XLA's before timing.

`mosaic_ragged_dots` gives the Mosaic kernels with `jax.lax.ragged_dot`'s
signature (benchmarks/moe.py runs its layer baselines on them).

Usage: python benchmarks/grouped_matmul.py [--save] [--no-mosaic] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from common import interleaved_ms, markdown_table, time_ms, write_results

# (rows, K, N, groups): DeepSeek-V3-like hidden 7168 / expert ffn 2048, and
# hidden 4096 / ffn 1408, with 8 and 32 local experts.
SHAPES = [(16384, 7168, 2048, 8), (16384, 2048, 7168, 8), (8192, 4096, 1408, 32),
          (8192, 1408, 4096, 32)]
SMOKE_SHAPES = [(256, 128, 64, 4), (256, 64, 128, 4)]
MOSAIC = ("tokamax", "mgpu")
HEADER = ["rows x K x N", "groups", "pass", "impl", "ms", "TFLOP/s", "best mosaic",
          "vs best mosaic", "vs xla"]
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
    print(f"mgpu {name} {args[0].shape}x{args[1].shape}: best {best} {best_ms:.3f} ms",
          flush=True)
    return best


def tune_mgpu(x, w, s) -> tuple[dict, dict, dict]:
    """The tile configurations of the forward, dX and dW kernels, each the
    fastest on these operands (x [M, K], w [G, K, N], group sizes s)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
    g = jnp.ones((x.shape[0], w.shape[2]), x.dtype)
    return (_best("fwd", lambda kw: lambda x, w: rd.ragged_dot(x, w, group_sizes=s, **kw),
                  (x, w)),
            _best("dx", lambda kw: lambda g, w: rd.ragged_dot(
                g, w, group_sizes=s, transpose_rhs=True, **kw), (g, w)),
            _best("dw", lambda kw: lambda x, g: trd.transposed_ragged_dot(
                x, g, group_sizes=s, **kw), (x, g)))


def mgpu_ragged_dot(tuned: dict) -> Callable:
    """jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=)
    on jax.experimental's Mosaic GPU kernels, with gradients (dX and dW
    kernels, a custom_vjp): `tuned` maps rhs's (K, N) to tune_mgpu's
    configurations."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd

    @jax.custom_vjp
    def f(x, w, s):
        return rd.ragged_dot(x, w, group_sizes=s, **tuned[w.shape[1:]][0])

    def f_bwd(res, g):
        x, w, s = res
        _, dx_kw, dw_kw = tuned[w.shape[1:]]
        g = g.astype(x.dtype)
        return (rd.ragged_dot(g, w, group_sizes=s, transpose_rhs=True, **dx_kw),
                trd.transposed_ragged_dot(x, g, group_sizes=s, **dw_kw), None)

    f.defvjp(lambda x, w, s: (f(x, w, s), (x, w, s)), f_bwd)

    def ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
        return f(lhs, rhs, group_sizes).astype(preferred_element_type or lhs.dtype)
    return ragged_dot


def tokamax_ragged_dot() -> Callable:
    """tokamax's Mosaic GPU ragged_dot (jax.lax.ragged_dot's signature);
    ImportError where tokamax is not installed. Its kernel writes lhs's
    dtype and its gradient kernels take operands of one dtype, so a wider
    preferred_element_type is a cast of its result (as mgpu_ragged_dot's):
    the cotangent reaches the kernels in lhs's dtype."""
    import tokamax

    def ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
        out = tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")
        return out.astype(preferred_element_type or lhs.dtype)
    return ragged_dot


def mosaic_ragged_dots(operands, only=MOSAIC) -> dict[str, Callable]:
    """{name: ragged_dot} of the Mosaic GPU kernels in `only` that run on
    every (x, w, group_sizes) of `operands` (mgpu tuned on them); each one
    left out is printed with the reason."""
    if jax.devices()[0].platform != "gpu":
        print(f"Mosaic GPU kernels ({', '.join(only)}) need a GPU: their rows left out",
              flush=True)
        return {}
    makers = {"tokamax": tokamax_ragged_dot,
              "mgpu": lambda: mgpu_ragged_dot({w.shape[1:]: tune_mgpu(x, w, s)
                                               for x, w, s in operands})}
    out = {}
    for name in only:
        try:
            f = makers[name]()
            for x, w, s in operands:
                jax.block_until_ready(jax.jit(f)(x, w, s))
        except Exception as e:  # noqa: BLE001: reported, rows left out
            print(f"{name} left out: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  flush=True)
            continue
        out[name] = f
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true", help="write results/grouped_matmul.json")
    ap.add_argument("--no-mosaic", action="store_true",
                    help="leave out the Mosaic GPU rows (tokamax, mgpu)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, few calls, nothing written (CPU too)")
    args = ap.parse_args()
    rng = np.random.default_rng()
    timing = dict(rounds=1, calls=2, batches=1) if args.smoke else {}
    rows, table = [], []
    for m, k, n, g in SMOKE_SHAPES if args.smoke else SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        s = jnp.asarray(_sizes(rng, m, g))
        dots = {"pk": functools.partial(pk_jax.grouped_matmul, mechanism="kernel"),
                "xla": jax.lax.ragged_dot}
        if not args.no_mosaic:
            dots.update(mosaic_ragged_dots([(x, w, s)]))
        impls = {name: functools.partial(f, group_sizes=s) for name, f in dots.items()}
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
            runs = interleaved_ms({impl: (lambda f=f: f(x, w)) for impl, f in fns.items()},
                                  **timing)
            times = {impl: float(np.median(t)) for impl, t in runs.items()}
            mosaic = {impl: ms for impl, ms in times.items() if impl in MOSAIC}
            best = min(mosaic, key=mosaic.get) if mosaic else None
            for impl, ms in times.items():
                rows.append({"op": "grouped_matmul", "shape": [m, k, n], "groups": g,
                             "pass": pass_, "dtype": "bfloat16", "implementation": impl,
                             "median_ms": ms, "baseline": best or "xla",
                             "baseline_median_ms": times[best or "xla"],
                             "mosaic_median_ms": mosaic, "xla_median_ms": times["xla"]})
                table.append([f"{m}x{k}x{n}", g, pass_, impl, f"{ms:.3f}",
                              f"{flops / (ms * 1e-3) / 1e12:.0f}", best or "-",
                              f"{times[best] / ms:.2f}x" if best else "-",
                              f"{times['xla'] / ms:.2f}x"])
            print(markdown_table(HEADER, table[-len(times):]), flush=True)
    md = ("One GPU, bf16, uniform random group sizes. best mosaic: the faster of tokamax's "
          "ragged_dot(implementation=\"mosaic\") and jax.experimental's Mosaic GPU kernels "
          "(mgpu: the best of its tile configurations per kernel and shape) in this run, the "
          "baseline of `vs best mosaic`; xla: jax.lax.ragged_dot (every group computed "
          "densely), for reference. fwd+bwd: value_and_grad in both operands (three GEMMs). "
          "TFLOP/s counts the useful work (2 x rows x K x N per GEMM).\n\n"
          + markdown_table(HEADER, table))
    if args.smoke:
        print("SMOKE_OK (nothing written)")
    elif args.save:
        write_results("grouped_matmul", rows, md, "python benchmarks/grouped_matmul.py --save")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
