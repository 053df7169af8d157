"""Expert parallelism: pk_jax.moe_dispatch / moe_combine and pk_jax.flax.MoE
against the baselines a JAX user runs in the same setting, same run,
interleaved rounds. Every row names its baseline: the fastest baseline of
its op in this run.

Implementations of the exchange (identity experts):
  * pk: moe_dispatch / moe_combine, mechanism "auto" (on one device one
    gather each way, across devices pk's exchange kernel: pk_jax/tuning.py
    moe_mechanism; on CPU the primitive's reference); pk_xla: mechanism "xla"
    (pk's layout, a dense lax.all_to_all);
  * baselines at world size 1 (benchmarks/baselines/moe_exchange.py):
    sort_gather: `argsort` of the flattened top-k ids, `x[order // k]`;
    combined either with a weighted `.at[token].add` (+scatter_add) or by
    undoing the sort and summing each token's k rows (+unsort);
  * baselines across devices: a2a_capacity (sort, then `lax.all_to_all` of
    [E, capacity] blocks, what MaxText-style code does; the capacity is the
    largest number of slots one rank sends one expert in this run's routing:
    the smallest that drops nothing, the most favorable to it; its capacity
    factor is printed), ragged_all_to_all (examples/moe.py's
    xla_ragged_dispatch / _combine: `lax.ragged_all_to_all`, each row's block
    found with pk's fused compare rather than searchsorted's while loop).

Ops: "dispatch" (the rows grouped by local expert and their group sizes,
from [T, H] tokens per rank with top-k routing, one jitted call, the layout
included) and "dispatch_combine" (dispatch then combine, the rows written
and read back between them: an optimization barrier stands for the experts);
with --shape decode also both as
CHAIN dependent calls in one program ("_chained", ms per call: the device
cost a decode step sees, the host's dispatch of a jitted call paid once);
"moe_layer_fwd_bwd": value_and_grad of the SwiGLU MoE layer (router,
dispatch, three grouped GEMMs, combine) in x and the parameters: pk's is
pk_jax.flax.MoE (pk_jax.grouped_matmul), the baselines are each baseline
exchange with each Mosaic GPU grouped GEMM a user has (tokamax's
`ragged_dot(implementation="mosaic")`, jax.experimental's kernels tuned in
this run: benchmarks/grouped_matmul.py), named "<exchange>+<gemm>". Without
a Mosaic kernel (no GPU, or neither runs) jax.lax.ragged_dot stands in,
which is printed: those layer rows are no headline.

Checks before timing: every exchange's combine(dispatch rows, each row times
1 + its expert's global id) against numpy, and every layer's loss and
gradients against pk's; an implementation that fails is left out, with the
reason printed (so no baseline that computes something else is timed).

Drop-less routing, uniform random expert choices (k distinct per token).
Every visible device is a rank of the expert axis (--ranks: the first few;
on CPU the example this imports asks for 8 fake devices).

Shapes (--shape; results/<name>.json with --save, <name>_ep<n> on n > 1
ranks): train (4096 tokens per rank, hidden 4096, top-2 of 8 experts: moe),
decode (128 tokens, hidden 7168, top-8 of 8: moe_decode), wide (16384
tokens, hidden 7168, top-8 of 64: moe_wide); each expert's ffn 2048. `--smoke`: tiny sizes, few calls, nothing
written (CPU too).

Usage: python benchmarks/moe.py [--shape train|decode|wide] [--tokens T] [--hidden H]
       [--experts E] [--topk K] [--ffn F] [--ranks N] [--smoke] [--save]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from baselines import moe_exchange as bx
from common import bench_setup, interleaved_ms, markdown_table, one_axis_mesh, write_results
from grouped_matmul import mosaic_ragged_dots
from pk_jax.flax import MoE, init_sharded, partition_specs
from pk_jax.ops.moe import segment_of

_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "moe.py"
_spec = importlib.util.spec_from_file_location("moe_example", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example
_spec.loader.exec_module(example)

# name: (tokens per rank, hidden, experts, top-k, results file)
SHAPES = {"train": (4096, 4096, 8, 2, "moe"), "decode": (128, 7168, 8, 8, "moe_decode"),
          "wide": (16384, 7168, 64, 8, "moe_wide")}
CHAIN = 16  # dependent calls in one program of a "_chained" row
PK_MECHANISMS = {"pk": "auto", "pk_xla": "xla"}


def _routing(rng, n, t, k, e):
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n * t)]).astype(np.int32)
    w = rng.random((n * t, k)).astype(np.float32)
    return ids, w / w.sum(1, keepdims=True)


def _capacity(ids: np.ndarray, n: int, e: int) -> int:
    """The largest number of slots one rank sends one expert ([n * T, k]
    global ids): a2a_capacity's smallest drop-free capacity."""
    per_rank = ids.reshape(n, -1)
    return int(max(np.bincount(r, minlength=e).max() for r in per_rank))


def _pk_dispatch(x, ids, axis, e, *, mechanism):
    rows, layout = pk_jax.moe_dispatch(x, ids, axis, num_experts=e, mechanism=mechanism)
    return rows, layout.group_sizes, layout


def exchanges(n: int, capacity: int) -> dict:
    """{name: (dispatch, combine, is_baseline)} for a world of n ranks."""
    out = {name: (functools.partial(_pk_dispatch, mechanism=m), pk_jax.moe_combine, False)
           for name, m in PK_MECHANISMS.items()}
    if n == 1:
        out["sort_gather+scatter_add"] = (bx.sort_gather_dispatch, bx.combine_scatter_add, True)
        out["sort_gather+unsort"] = (bx.sort_gather_dispatch, bx.combine_unsort, True)
    else:
        out["a2a_capacity"] = (functools.partial(bx.a2a_capacity_dispatch, capacity=capacity),
                               bx.a2a_capacity_combine, True)
        out["ragged_all_to_all"] = (example.xla_ragged_dispatch, example.xla_ragged_combine,
                                    True)
    return out


def _chained(f, e):
    """CHAIN dependent calls of f(x, ids, w) in one program."""
    def g(x, ids, w):
        for i in range(CHAIN):
            out = f(x, (ids + i) % e, w)
            x = (out[0] if isinstance(out, tuple) else out)[: x.shape[0]]  # dispatch: its rows
        return x
    return g


def _materialized(rows, group_sizes):
    """The experts of the dispatch + combine rows: none, but the rows are
    written and read back (an optimization barrier, as the experts' GEMMs
    would make them); without it XLA composes dispatch's gather and
    combine's into one and no row is ever written."""
    del group_sizes
    return lax.optimization_barrier(rows)


def _times_expert(rows, group_sizes):
    """Each row times 1 + the global id of its expert (the check's experts)."""
    el = group_sizes.shape[0]
    local = segment_of(jnp.arange(rows.shape[0], dtype=jnp.int32), jnp.cumsum(group_sizes))
    scale = 1 + lax.axis_index("ep") * el + local
    return (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype)


def exchange_fns(mesh, e, ex: dict, chained: bool) -> dict:
    """{op: {name: (jitted f(x, ids, w), calls per f, is_baseline)}}, and op
    "check": each exchange's combine(dispatch rows times their expert)."""
    spec = P("ep")
    sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    fns = {"dispatch": {}, "dispatch_combine": {}, "check": {}}
    for name, (dispatch, combine, base) in ex.items():
        def dc(x, ids, w, dispatch=dispatch, combine=combine, experts=_materialized):
            rows, sizes, state = dispatch(x, ids, "ep", e)
            return combine(experts(rows, sizes), w, state)
        if all(d.keywords.get("dispatch") is not dispatch for d, _ in fns["dispatch"].values()):
            # one dispatch row for the exchanges that share it (sort_gather+...): the
            # rows and their group sizes, what the experts' grouped GEMM reads
            fns["dispatch"][name.split("+")[0]] = (functools.partial(
                lambda x, ids, w, dispatch: dispatch(x, ids, "ep", e)[:2], dispatch=dispatch),
                base)
        fns["dispatch_combine"][name] = (dc, base)
        fns["check"][name] = (functools.partial(dc, experts=_times_expert), base)
    out = {}
    for op, named in fns.items():
        out[op] = {name: (sm(f), 1, base) for name, (f, base) in named.items()}
        if chained and op != "check":
            out[op + "_chained"] = {name: (sm(_chained(f, e)), CHAIN, base)
                                    for name, (f, base) in named.items()}
    return out


def _passed(op: str, name: str, ok: set[str]) -> bool:
    """Whether `name`'s row of `op` was checked: a dispatch row by any exchange
    that shares it."""
    if op.startswith("dispatch_combine"):
        return name in ok
    return any(o.split("+")[0] == name for o in ok)


def check_exchanges(fns: dict, x, ids, w) -> set[str]:
    """The names whose combine(dispatch rows times 1 + expert id) matches
    numpy; each one that does not is printed."""
    xs = np.asarray(x, np.float32)
    want = np.einsum("tk,td->td", np.asarray(w) * (1 + np.asarray(ids)), xs)
    ok = set()
    for name, (f, _, _) in fns.items():
        err = float(np.abs(np.asarray(f(x, ids, w), np.float32) - want).max())
        if err <= 1e-2 * float(np.abs(want).max()):
            ok.add(name)
        else:
            print(f"!!!! {name}: FAILED the exchange check (largest error {err:.3e}): left out",
                  flush=True)
    return ok


def layer_fns(mesh, n, h, ffn, e, k, dtype, x, gemm_names) -> tuple[dict, nnx.State]:
    """{implementation: (jitted value_and_grad fn(state, x), is_baseline)} of
    the MoE layer, and the state (one set of parameters, shared)."""
    make = lambda cls: lambda: cls(h, ffn, e, k, axis_name="ep", num_shards=n, dtype=dtype,
                                   rngs=nnx.Rngs(0))
    graphdef, state = init_sharded(make(MoE), mesh)
    specs = partition_specs(state)
    ids = np.asarray(jax.jit(jax.shard_map(
        lambda s, x: nnx.merge(graphdef, s).route(x)[1], mesh=mesh,
        in_specs=(specs, P("ep")), out_specs=P("ep")))(state, x))
    capacity = _capacity(ids, n, e)
    el = e // n
    # The Mosaic kernels, tuned on rank 0's rows of this routing.
    sizes = jnp.asarray(np.bincount(ids.ravel(), minlength=e)[:el].astype(np.int32))
    rng = np.random.default_rng(0)
    operand = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) / fan_in ** 0.5, dtype)
    rows = ids.size                                   # pk's rows per rank: n * T * k
    gemms = mosaic_ragged_dots([(operand((rows, h), 1), operand((el, h, ffn), h), sizes),
                                (operand((rows, ffn), 1), operand((el, ffn, h), ffn), sizes)],
                               only=gemm_names)
    if not gemms:
        print("layer baselines on jax.lax.ragged_dot (no Mosaic GPU grouped GEMM here): "
              "those rows are no headline", flush=True)
        gemms = {"lax_ragged_dot": lax.ragged_dot}
    classes = {name: (functools.partial(MoE, mechanism=m), False)
               for name, m in PK_MECHANISMS.items()}
    for name, (dispatch, combine, base) in exchanges(n, capacity).items():
        if base:
            for g, dot in gemms.items():
                classes[f"{name}+{g}"] = (type("BaselineMoE", (example.XlaRaggedMoE,), dict(
                    dispatch=staticmethod(dispatch), combine=staticmethod(combine),
                    grouped_dot=staticmethod(dot))), True)
    out = {}
    for name, (cls, base) in classes.items():
        gd = nnx.split(nnx.eval_shape(make(cls)))[0]

        # tokamax's ragged_dot gradient does not carry shard_map's varying
        # axes (check_vma rejects it): the baselines run unchecked.
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                           out_specs=P("ep"), check_vma=not base)
        def apply(state, x, gd=gd):
            return nnx.merge(gd, state)(x)

        loss = lambda s, x, apply=apply: jnp.sum(apply(s, x).astype(jnp.float32) ** 2)
        out[name] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), base)
    if n > 1:
        print(f"layer routing: a2a_capacity's capacity {capacity} (capacity factor "
              f"{capacity * e / (ids.size // n):.2f})", flush=True)
    return out, state


def check_layers(fns: dict, state, x) -> set[str]:
    """The layers whose loss and gradients match pk's (relative error of
    each, in norm, at most 3e-2: bf16 GEMMs); each one that does not is
    printed."""
    rel = lambda a, b: jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.maximum(
        jnp.linalg.norm(b.astype(jnp.float32)), 1e-30)
    want = fns["pk"][0](state, x)
    ok = set()
    for name, (f, _) in fns.items():
        err = max(float(r) for r in jax.tree.leaves(jax.tree.map(rel, f(state, x), want)))
        if err <= 3e-2:
            ok.add(name)
        else:
            print(f"!!!! {name}: FAILED the layer check against pk (largest relative error "
                  f"{err:.2e}): left out", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="train")
    parser.add_argument("--tokens", type=int, help="tokens per rank")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--topk", type=int)
    parser.add_argument("--ffn", type=int, default=2048, help="each expert's hidden width")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ranks", type=int, help="the first RANKS devices (default: all)")
    parser.add_argument("--mosaic", default="tokamax,mgpu",
                        help="the Mosaic GPU grouped GEMMs the layer baselines try")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, few calls, nothing written (CPU too)")
    parser.add_argument("--save", action="store_true", help="write results/<shape's file>.json")
    args = parser.parse_args()
    t, h, e, k, result = SHAPES[args.shape]
    if args.smoke:
        t, h, args.ffn, e = 64, 128, 64, 8
    t, h, e, k = (args.tokens or t, args.hidden or h, args.experts or e,
                  min(args.topk or k, args.experts or e))
    devices, _, rng = bench_setup("ep")
    devices = devices[: args.ranks]
    mesh = one_axis_mesh(devices, "ep")
    n, dtype = len(devices), jnp.dtype(args.dtype)
    if e % n:
        parser.error(f"--experts {e} must be a multiple of the {n} devices")
    # pk's exchange stages every routed row (n * t * k rows of h values) in one
    # workspace region of the next power of two: make room for it ("wide").
    staged = n * t * k * h * dtype.itemsize
    region, base = 1 << (staged - 1).bit_length(), pk_jax.config.get_config().workspace_bytes
    if region > base // 2:
        pk_jax.configure(workspace_bytes=base + region)
    shape = dict(ranks=n, tokens_per_rank=t, hidden=h, experts=e, top_k=k, ffn=args.ffn,
                 dtype=str(dtype))
    sharding = NamedSharding(mesh, P("ep"))
    put = lambda a: jax.device_put(a, sharding)
    x = put(jnp.asarray(rng.standard_normal((n * t, h)), dtype))
    ids_np, w_np = _routing(rng, n, t, k, e)
    ids, w = put(ids_np), put(w_np)
    capacity = _capacity(ids_np, n, e)
    timing = dict(rounds=1, calls=2, batches=1) if args.smoke else {}
    times = {}

    with jax.set_mesh(mesh):
        ops = exchange_fns(mesh, e, exchanges(n, capacity), chained=args.shape == "decode")
        ok = check_exchanges(ops.pop("check"), x, ids, w)
        for op, fns in ops.items():
            runs = interleaved_ms({name: (lambda f=f: f(x, ids, w))
                                   for name, (f, _, _) in fns.items() if _passed(op, name, ok)},
                                  **timing)
            for name, r in runs.items():
                times[(op, name)] = (float(np.median(r)) / fns[name][1], fns[name][2])
        mosaic = tuple(filter(None, args.mosaic.split(",")))
        layers, state = layer_fns(mesh, n, h, args.ffn, e, k, dtype, x, mosaic)
        ok = check_layers(layers, state, x)
        runs = interleaved_ms({name: (lambda f=f: f(state, x))
                               for name, (f, _) in layers.items() if name in ok}, **timing)
        for name, r in runs.items():
            times[("moe_layer_fwd_bwd", name)] = (float(np.median(r)), layers[name][1])
    pk_jax.check_errors()

    rows = []
    for op in dict.fromkeys(op for op, _ in times):
        base = {name: ms for (o, name), (ms, b) in times.items() if o == op and b}
        best = min(base, key=base.get) if base else None
        for (o, name), (ms, b) in times.items():
            if o == op:
                rows.append(dict(op=op, implementation=name, is_baseline=b, median_ms=ms,
                                 baseline=best, baseline_median_ms=base.get(best),
                                 baselines_median_ms=base, capacity=capacity, **shape))
    table = markdown_table(
        ["op", "impl", "ms", "baseline (fastest in this run)", "vs baseline"],
        [[r["op"], r["implementation"], f"{r['median_ms']:.3f}", r["baseline"] or "-",
          f"{r['baseline_median_ms'] / r['median_ms']:.2f}x" if r["baseline"] else "-"]
         for r in rows])
    what = (f"{n} ranks x {t} tokens, hidden {h}, {e} experts, top-{k}, ffn {args.ffn}, "
            f"{dtype}" + (f"; a2a_capacity's capacity {capacity} (capacity factor "
                          f"{capacity * e / (t * k):.2f})" if n > 1 else ""))
    print(f"{what}\n{table}")
    if args.smoke:
        print("SMOKE_OK (nothing written)")
    elif args.save:
        write_results(result if n == 1 else f"{result}_ep{n}", rows,
                      f"MoE dispatch, dispatch + combine and layer fwd+bwd ({what}). Each "
                      f"ratio is against the fastest baseline of its op in this run "
                      f"(benchmarks/moe.py's docstring says what each is): at one rank "
                      f"sort_gather (+scatter_add, +unsort); across ranks a2a_capacity and "
                      f"ragged_all_to_all; the layer's baselines run their grouped GEMMs on "
                      f"the Mosaic GPU kernels of --mosaic ({', '.join(mosaic)}). pk: "
                      f"pk_jax.moe_dispatch/combine (mechanism 'auto'; pk_xla: 'xla') and "
                      f"pk_jax.flax.MoE "
                      f"(pk_jax.grouped_matmul). Every implementation was checked before "
                      f"timing.\n\n{table}",
                      "python benchmarks/moe.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
