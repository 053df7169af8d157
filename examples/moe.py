"""A small mixture-of-experts transformer in Flax NNX, expert parallel over
one mesh axis "ep", trained with pk_jax's MoE layer and with the XLA
baseline (the same model and parameters).

Each device holds batch / ep sequences (the expert axis is also the data
axis); attention, norms, embeddings and the LM head are replicated and run
locally; every MLP is a `pk_jax.flax.MoE` (router, top-k, SwiGLU experts
sharded over "ep", grouped GEMMs with `jax.lax.ragged_dot`).

  --collectives pk          pk_jax.moe_dispatch / moe_combine
  --collectives xla_ragged  what a JAX user writes: sort the slots by expert,
                            exchange counts with lax.all_to_all, rows with
                            jax.lax.ragged_all_to_all, regroup by local
                            expert, ragged_dot, and back; autodiff for the
                            backward pass. XLA:CPU has no ragged-all-to-all
                            (jax 0.10), so on CPU the row exchange is its
                            dense equivalent (`ragged_all_to_all_dense`: a
                            padded lax.all_to_all, then gathers); GPUs run
                            the real collective.
  --collectives both        both, step times side by side, losses compared.

    python examples/moe.py [--steps 30] [--collectives {pk,xla_ragged,both}]

The data is the synthetic repeating pattern of examples/flax_transformer.py;
the training loop is examples/_train_util.py's (shared with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pk_jax.flax import MoE, init_sharded, shard_size
from pk_jax.ops.moe import segment_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/ is not a package
from _train_util import (  # noqa: E402
    LMConfig, adam_trainer, batches, fake_cpu_devices, largest_relative_difference,
    sharded_lm_loss, train_loop)

fake_cpu_devices(8)  # only affects the CPU backend: 8 fake devices when there is no GPU

TOKENS = P("ep")  # [batch, seq]: batch over "ep"
COLLECTIVES = ("pk", "xla_ragged")


@dataclasses.dataclass(frozen=True)
class Config(LMConfig):
    """Model, data and optimizer sizes (small defaults: CPU in seconds):
    LMConfig's (vocab, d_model, num_heads, num_layers, period, learning_rate,
    dtype) and the experts'."""

    hidden: int = 64          # each expert's hidden width
    num_experts: int = 8
    top_k: int = 2
    batch: int = 16
    seq_len: int = 32


# ---- the XLA baseline: ragged_all_to_all + ragged_dot ------------------------------
def _exclusive_cumsum(a):
    return jnp.cumsum(a) - a


def ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics with a padded `lax.all_to_all`
    (blocks of operand.shape[0] rows per peer) and gathers: the CPU stand-in."""
    n = input_offsets.shape[0]
    bound = operand.shape[0]
    i = jnp.arange(bound)
    src = jnp.clip(input_offsets[:, None] + i, 0, bound - 1)
    blocks = jnp.where((i < send_sizes[:, None])[..., None], operand[src], 0)
    got = lax.all_to_all(blocks, axis_name, 0, 0)                  # [source, bound, H]
    where = lax.all_to_all(output_offsets[:, None], axis_name, 0, 0)[:, 0]
    p = jnp.arange(output.shape[0])
    for s in range(n):
        inside = (p >= where[s]) & (p < where[s] + recv_sizes[s])
        output = jnp.where(inside[:, None], got[s, jnp.clip(p - where[s], 0, bound - 1)], output)
    return output


def _ragged_a2a(operand, rows, in_off, send, out_off, recv, axis_name):
    output = lax.pcast(jnp.zeros((rows,) + operand.shape[1:], operand.dtype), axis_name,
                       to="varying")
    args = (operand, output, in_off, send, out_off, recv)
    return lax.platform_dependent(
        *args, cpu=lambda *a: ragged_all_to_all_dense(*a, axis_name=axis_name),
        default=lambda *a: lax.ragged_all_to_all(*a, axis_name=axis_name))


def xla_ragged_dispatch(tokens: jax.Array, ids: jax.Array, axis: str, num_experts: int):
    """Drop-less dispatch as a JAX user writes it: sort the [T, k] slots by
    expert, exchange the counts (lax.all_to_all) and the rows
    (ragged_all_to_all), regroup the received (source, expert) blocks by
    local expert (each row's block found with pk's fused compare,
    `segment_of`, rather than `jnp.searchsorted`'s while loop). Returns
    (rows [n*T*k, H], group_sizes, state for combine)."""
    n = lax.axis_size(axis)
    local = num_experts // n
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                      # by destination, local expert
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1).reshape(n, local)
    send = counts.sum(1)
    in_off = _exclusive_cumsum(send)
    recv_counts = lax.all_to_all(counts, axis, 0, 0)              # [source, local expert]
    recv = recv_counts.sum(1)
    recv_off = _exclusive_cumsum(recv)
    out_off = lax.all_to_all(recv_off[:, None], axis, 0, 0)[:, 0]
    back_off = lax.all_to_all(in_off[:, None], axis, 0, 0)[:, 0]
    rows = n * t * k
    got = _ragged_a2a(tokens[order // k], rows, in_off, send, out_off, recv, axis)
    ends = jnp.cumsum(recv_counts.reshape(-1))
    p = jnp.arange(rows)
    label = jnp.where(p < ends[-1], segment_of(p, ends) % local, local)
    perm = jnp.argsort(label, stable=True)
    state = (order, perm, send, recv, recv_off, back_off, (t, k), axis)
    return got[perm], recv_counts.sum(0), state


def xla_ragged_combine(y: jax.Array, weights: jax.Array, state) -> jax.Array:
    """The way back: undo the regrouping, ragged_all_to_all to the sources,
    unsort, weighted sum over the k choices (fp32). [T, H] in y's dtype."""
    order, perm, send, recv, recv_off, back_off, (t, k), axis = state
    y = jnp.zeros_like(y).at[perm].set(y)
    back = _ragged_a2a(y, t * k, recv_off, recv, back_off, send, axis)
    out = jnp.zeros_like(back).at[order].set(back).reshape(t, k, -1)
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32),
                      out.astype(jnp.float32)).astype(y.dtype)


class XlaRaggedMoE(MoE):
    """The same layer and parameters as `MoE`, with the exchange and the
    grouped GEMMs a JAX user writes (drop-less): xla_ragged_dispatch /
    xla_ragged_combine and jax.lax.ragged_dot."""

    grouped_dot = staticmethod(lax.ragged_dot)
    # The exchange (a subclass may swap it: benchmarks/moe.py's baselines).
    dispatch = staticmethod(xla_ragged_dispatch)
    combine = staticmethod(xla_ragged_combine)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.dtype) if self.dtype is not None else x.dtype
        tokens = x.reshape(-1, self.features)
        # Routed on the input as given, as MoE does: routing on the cast tokens
        # would pick other experts for near ties.
        weights, ids = self.route(tokens)
        rows, group_sizes, state = self.dispatch(tokens.astype(dt), ids, self.axis_name,
                                                 self.num_experts)
        out = self.combine(self.experts(rows, group_sizes), weights, state)
        return out.reshape(x.shape).astype(dt)


# ---- the model ---------------------------------------------------------------------
class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: Config, ep: int, collectives: str, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, dtype=dtype,
                                           use_bias=False, decode=False, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        layer = {"pk": MoE, "xla_ragged": XlaRaggedMoE}[collectives]
        self.moe = layer(cfg.d_model, cfg.hidden, cfg.num_experts, cfg.top_k, axis_name="ep",
                         num_shards=ep, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), mask=mask)
        return x + self.moe(self.moe_norm(x))


class Transformer(nnx.Module):
    """Decoder-only LM; called per shard on tokens [batch / ep, seq]."""

    def __init__(self, cfg: Config, ep: int, collectives: str, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, ep, collectives, rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x)).astype(jnp.float32)


def make_mesh(ep: int | None = None, axis_types: AxisType = AxisType.Explicit) -> Mesh:
    """An ("ep",) mesh over the first `ep` default devices (all by default)."""
    ep = ep or len(jax.devices())
    return jax.make_mesh((ep,), ("ep",), axis_types=(axis_types,),
                         devices=jax.devices()[:ep])


PRESETS = {
    "small": Config(),
    "gpu": Config(vocab=4096, d_model=1024, num_heads=8, hidden=1024, num_experts=8,
                  top_k=2, num_layers=2, batch=8, seq_len=1024, period=64,
                  dtype="bfloat16"),
}


def train_timed(steps: int, collectives: str, cfg: Config, mesh: Mesh | None = None,
                log: Callable[[str], None] = print) -> tuple[list[float], float]:
    """Train `steps` Adam steps on the repeating token pattern (`batches`);
    (loss of every step, median step time in ms over steps 2.. (step 1
    compiles); nan with one step)."""
    mesh = mesh or make_mesh()
    with jax.set_mesh(mesh):
        return _train(steps, collectives, cfg, mesh, log)


def _train(steps, collectives, cfg, mesh, log):
    ep = mesh.shape["ep"]
    shard_size(cfg.batch, ep, "batch")
    graphdef, params = init_sharded(lambda: Transformer(cfg, ep, collectives, nnx.Rngs(0)),
                                    mesh)
    trainer = adam_trainer(
        sharded_lm_loss(graphdef, params, mesh, TOKENS), params, cfg.learning_rate,
        NamedSharding(mesh, TOKENS),
        f"mesh ep={ep} on {mesh.devices.flat[0].device_kind}; collectives={collectives}; "
        f"{cfg.num_experts} experts, top-{cfg.top_k}; dtype={cfg.dtype}")
    return train_loop(steps, trainer, batches(cfg), log, statistic="median")


def compare(steps: int, cfg: Config, mesh: Mesh,
            log: Callable[[str], None] = print) -> dict:
    """Train with pk and with the XLA baseline; print step times side by side
    and the largest relative loss difference; return both runs."""
    runs = {c: train_timed(steps, c, cfg, mesh, log) for c in COLLECTIVES}
    (pk_loss, pk_ms), (xla_loss, xla_ms) = runs["pk"], runs["xla_ragged"]
    diff = largest_relative_difference(pk_loss, xla_loss)
    log(f"step time: pk {pk_ms:.1f} ms, xla_ragged {xla_ms:.1f} ms: {xla_ms / pk_ms:.2f}x; "
        f"largest relative loss difference {diff:.1e}")
    return dict(runs=runs, loss_diff=diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--collectives", choices=COLLECTIVES + ("both",), default="both")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="small")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    mesh = make_mesh(args.ep)
    if args.collectives == "both":
        compare(args.steps, cfg, mesh)
    else:
        train_timed(args.steps, args.collectives, cfg, mesh)


if __name__ == "__main__":
    main()
