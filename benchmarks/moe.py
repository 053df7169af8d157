"""Expert parallelism: pk_jax.moe_dispatch / moe_combine and pk_jax.flax.MoE
against the XLA baseline (jax.lax.ragged_all_to_all + ragged_dot, written as
a JAX user would: examples/moe.py's xla_ragged_dispatch / _combine), same run.

Rows (with --save: benchmarks/results/moe.json, moe_decode.json with --decode):
  * op "dispatch": the rows grouped by local expert from [T, H] tokens per
    rank with top-k routing, one jitted call (the layout included);
  * op "dispatch_combine": dispatch then combine (identity experts), one
    jitted call;
  * with `--decode`, ops "dispatch_chained" and "dispatch_combine_chained":
    CHAIN dependent calls in one jitted program (each call's routing shifted
    by its step, its first T rows the next call's tokens), ms per call: the
    device cost a decode step sees, the host's dispatch of a jitted call
    (tens of microseconds) paid once per program;
  * op "moe_layer_fwd_bwd": value_and_grad of the SwiGLU MoE layer (router,
    dispatch, three grouped GEMMs: pk_jax.grouped_matmul / ragged_dot,
    combine) with respect to x and the parameters.

Drop-less routing, uniform random expert choices (k distinct per token).
Every visible device is a rank of the expert axis; with one GPU this is a
world-size-1 run (no communication). `--smoke` is a tiny shape that also
runs on CPU; `--decode` the decode-sized shape (128 tokens per rank, hidden
7168, top-8).

Usage: python benchmarks/moe.py [--tokens 4096] [--hidden 4096] [--experts 8]
       [--topk 2] [--ffn 2048] [--smoke | --decode] [--save]
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from common import bench_setup, markdown_table, time_ms, write_results
from pk_jax.flax import MoE, init_sharded, partition_specs

_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "moe.py"
_spec = importlib.util.spec_from_file_location("moe_example", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example
_spec.loader.exec_module(example)


def _routing(rng, n, t, k, e):
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n * t)]).astype(np.int32)
    w = rng.random((n * t, k)).astype(np.float32)
    return ids, w / w.sum(1, keepdims=True)


# pk's rows: {implementation: moe mechanism}; "auto" is pk's ld_st exchange
# kernel where it can run (on CPU its primitive's reference).
PK_IMPLS = {"pk": "auto"}


CHAIN = 16  # dependent calls in one program of a "_chained" row


def _chained(f, e):
    """CHAIN dependent calls of f(x, ids, w) in one program."""
    def g(x, ids, w):
        for i in range(CHAIN):
            x = f(x, (ids + i) % e, w)[: x.shape[0]]
        return x
    return g


def exchange_fns(mesh, e, chained=False) -> dict:
    """{op: {implementation: (jitted f(x, ids, w), calls per f)}} (identity
    experts): op "dispatch" (rows grouped by local expert) and
    "dispatch_combine" (the round trip, [T, H]); `chained`: also both as
    CHAIN dependent calls in one program ("<op>_chained")."""
    def pk(x, ids, w, mechanism, combine):
        rows, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=e, mechanism=mechanism)
        return pk_jax.moe_combine(rows, w, lay) if combine else rows

    def xla(x, ids, w, combine):
        rows, _, state = example.xla_ragged_dispatch(x, ids, "ep", e)
        return example.xla_ragged_combine(rows, w, state) if combine else rows
    spec = P("ep")
    out = {}
    for op, combine in (("dispatch", False), ("dispatch_combine", True)):
        fns = {name: functools.partial(pk, mechanism=m, combine=combine)
               for name, m in PK_IMPLS.items()}
        fns["xla_ragged"] = functools.partial(xla, combine=combine)
        for suffix, wrap, calls in (("", lambda f: f, 1),
                                    ("_chained", lambda f: _chained(f, e), CHAIN)):
            if suffix and not chained:
                continue
            out[op + suffix] = {
                name: (jax.jit(jax.shard_map(wrap(f), mesh=mesh,
                                             in_specs=(spec,) * 3, out_specs=spec)), calls)
                for name, f in fns.items()}
    return out


def layer_fns(mesh, n, h, ffn, e, k, dtype):
    """{implementation: (jitted grad fn(state, x), state)} of the MoE layer."""
    out = {}
    layers = {name: functools.partial(MoE, mechanism=m) for name, m in PK_IMPLS.items()}
    layers["xla_ragged"] = example.XlaRaggedMoE
    for name, cls in layers.items():
        graphdef, state = init_sharded(
            lambda: cls(h, ffn, e, k, axis_name="ep", num_shards=n, dtype=dtype,
                        rngs=nnx.Rngs(0)), mesh)

        @jax.shard_map(mesh=mesh, in_specs=(partition_specs(state), P("ep")),
                       out_specs=P("ep"))
        def apply(state, x, graphdef=graphdef):
            return nnx.merge(graphdef, state)(x)

        loss = lambda s, x, apply=apply: jnp.sum(apply(s, x).astype(jnp.float32) ** 2)
        out[name] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), state)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=2048, help="each expert's hidden width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU too)")
    parser.add_argument("--decode", action="store_true",
                        help="decode-sized: 128 tokens per rank, hidden 7168, top-8")
    parser.add_argument("--save", action="store_true", help="write results/moe.json")
    args = parser.parse_args()
    if args.decode:
        args.tokens, args.hidden, args.topk = 128, 7168, min(8, args.experts)
    if args.smoke:  # tiny shapes, with --decode too
        args.tokens, args.hidden, args.ffn, args.experts = 64, 128, 64, 8
    devices, mesh, rng = bench_setup("ep")
    n, t, h, e, k = len(devices), args.tokens, args.hidden, args.experts, args.topk
    dtype = jnp.dtype(args.dtype)
    if e % n:
        parser.error(f"--experts {e} must be a multiple of the {n} devices")
    shape = dict(ranks=n, tokens_per_rank=t, hidden=h, experts=e, top_k=k, ffn=args.ffn,
                 dtype=str(dtype))
    sharding = NamedSharding(mesh, P("ep"))
    put = lambda a: jax.device_put(a, sharding)
    x = put(jnp.asarray(rng.standard_normal((n * t, h)), dtype))
    ids, w = map(put, _routing(rng, n, t, k, e))
    rows, times = [], {}

    with jax.set_mesh(mesh):
        ops = exchange_fns(mesh, e, chained=args.decode)
        checked = "dispatch_combine_chained" if args.decode else "dispatch_combine"
        outs = {name: np.asarray(f(x, ids, w), np.float32)
                for name, (f, _) in ops[checked].items()}
        err = max(float(np.abs(o - outs["xla_ragged"]).max()) for o in outs.values())
        assert err <= 1e-2 * float(np.abs(outs["xla_ragged"]).max()), (checked, err)
        for op, fns in ops.items():
            for name, (f, calls) in fns.items():
                times[(op, name)] = time_ms(lambda f=f: f(x, ids, w)) / calls
        for name, (f, state) in layer_fns(mesh, n, h, args.ffn, e, k, dtype).items():
            times[("moe_layer_fwd_bwd", name)] = time_ms(lambda f=f, s=state: f(s, x))
    pk_jax.check_errors()
    for (op, name), ms in times.items():
        rows.append(dict(op=op, implementation=name, median_ms=ms, baseline="xla_ragged",
                         baseline_median_ms=times[(op, "xla_ragged")], **shape))
    table = markdown_table(
        ["op", "impl", "ms", "vs xla_ragged"],
        [[r["op"], r["implementation"], f"{r['median_ms']:.3f}",
          f"{r['baseline_median_ms'] / r['median_ms']:.2f}x"] for r in rows])
    print(f"{n} ranks x {t} tokens, hidden {h}, {e} experts, top-{k}, ffn {args.ffn}, "
          f"{dtype}; largest |pk* - xla_ragged| {err:.2e}\n{table}")
    if args.save:
        write_results("moe_decode" if args.decode else "moe", rows,
                      f"MoE dispatch, dispatch + combine and layer fwd+bwd ({n} ranks, {t} tokens per "
                      f"rank, hidden {h}, {e} experts, top-{k}, ffn {args.ffn}, {dtype}); "
                      f"pk: pk_jax.moe_dispatch/combine (mechanism 'auto': pk's exchange "
                      f"kernel) and pk_jax.flax.MoE (experts on pk_jax.grouped_matmul); "
                      f"xla_ragged: examples/moe.py's baseline (ragged_all_to_all + "
                      f"ragged_dot).\n\n{table}",
                      "python benchmarks/moe.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
