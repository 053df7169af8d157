"""A small decoder-only transformer in Flax NNX, trained with pk_jax's
collectives over a 2-D mesh ("sp" for the sequence, "tp" for the tensor).

The model code runs per shard inside one `jax.shard_map` (see
`pk_jax.flax.layers` for the pattern). Each device holds tokens
[batch / tp, seq / sp]: the sequence is split over "sp", and the batch over
"tp" (the token rows that the tensor-parallel layers gather and scatter
along their first dim; Megatron's sequence parallelism, on the batch dim):

  * token and position embeddings, RMSNorms, LM head: replicated, local;
  * attention (`RingSelfAttention`, GQA, causal): q/k/v column-parallel
    over "tp" (heads sharded; one all-gather of the rows), ring attention
    over "sp", output projection row-parallel over "tp" (reduce-scatter);
  * gated MLP (`ParallelMLP`): column-parallel gate/up, row-parallel down.

The data is synthetic: a fixed pattern of tokens repeating from a random
offset, so the next token follows from the current one and the loss drops
quickly. `--collectives xla` runs every pk op with mechanism="xla" (XLA's
collectives: the baseline); the losses agree.

    python examples/flax_transformer.py [--steps 50] [--collectives {pk,xla}]

Runs on GPUs unchanged (use --dtype bfloat16 there for the fused kernels) or
on 8 fake CPU devices.
"""

from __future__ import annotations

import os

# Only affects the CPU backend: gives 8 fake devices when there is no GPU.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pk_jax.flax import (ParallelMLP, RingSelfAttention, init_sharded,  # noqa: E402
                         partition_specs, shard_size)

TOKENS = P("tp", "sp")  # [batch, seq]: batch over "tp", sequence over "sp"


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and optimizer sizes (small defaults: CPU in seconds)."""

    vocab: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 128
    num_layers: int = 2
    batch: int = 8
    seq_len: int = 64
    period: int = 16  # length of the repeating token pattern
    learning_rate: float = 3e-3
    dtype: str = "float32"  # computation dtype; parameters stay float32


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Config, tp: int, mechanism: str, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = RingSelfAttention(
            shard_size(cfg.num_heads, tp, "num_heads"),
            shard_size(cfg.num_kv_heads, tp, "num_kv_heads"), cfg.head_dim, cfg.d_model,
            axis_name="sp", tp_axis_name="tp", causal=True, dtype=dtype, rngs=rngs,
            mechanism=mechanism)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.mlp = ParallelMLP(cfg.d_model, shard_size(cfg.hidden, tp, "hidden"),
                               axis_name="tp", dtype=dtype, rngs=rngs, mechanism=mechanism)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """Decoder-only LM; called per shard on tokens [batch / tp, seq / sp]."""

    def __init__(self, cfg: Config, tp: int, mechanism: str, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, tp, mechanism, rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        s_local = tokens.shape[1]
        positions = lax.axis_index("sp") * s_local + jnp.arange(s_local)  # global positions
        x = self.embed(tokens) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def make_mesh(sp: int | None = None, tp: int | None = None) -> Mesh:
    """An (sp, tp) mesh over the default devices; tp defaults to 2 where
    the device count is even, sp to the rest."""
    n = len(jax.devices())
    tp = tp or (2 if n % 2 == 0 else 1)
    sp = sp or n // tp
    devices = np.array(jax.devices()[:sp * tp]).reshape(sp, tp)
    return Mesh(devices, ("sp", "tp"), axis_types=(AxisType.Auto,) * 2)


def batches(cfg: Config, seed: int = 0):
    """Endless (inputs, targets) [batch, seq_len] int32: one fixed pattern
    of `period` distinct tokens, repeating from a random offset per row."""
    rng = np.random.default_rng(seed)
    pattern = rng.permutation(cfg.vocab)[:cfg.period]
    while True:
        offsets = rng.integers(cfg.period, size=(cfg.batch, 1))
        tokens = pattern[(offsets + np.arange(cfg.seq_len + 1)) % cfg.period].astype(np.int32)
        yield tokens[:, :-1], tokens[:, 1:]


def make_loss(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh) -> Callable:
    """loss(params, inputs, targets): mean next-token cross-entropy over the
    global batch, with the model run per shard."""

    @jax.shard_map(mesh=mesh, in_specs=(partition_specs(params), TOKENS, TOKENS),
                   out_specs=P(("sp", "tp")))
    def per_shard(params, inputs, targets):
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()[None]

    # Every shard holds as many tokens: the mean of the shard means is the mean.
    return lambda params, inputs, targets: per_shard(params, inputs, targets).mean()


def train(steps: int = 50, collectives: str = "pk", cfg: Config = Config(),
          mesh: Mesh | None = None, log: Callable[[str], None] = print) -> list[float]:
    """Train `steps` Adam steps; returns the loss of every step."""
    mesh = mesh or make_mesh()
    sp, tp = mesh.shape["sp"], mesh.shape["tp"]
    shard_size(cfg.batch, tp, "batch")
    shard_size(cfg.seq_len, sp, "seq_len")
    mechanism = {"pk": "auto", "xla": "xla"}[collectives]
    graphdef, params = init_sharded(
        lambda: Transformer(cfg, tp, mechanism, nnx.Rngs(0)), mesh)
    loss_fn = make_loss(graphdef, params, mesh)
    tx = optax.adam(cfg.learning_rate)
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    log(f"mesh sp={sp} x tp={tp} on {mesh.devices.flat[0].device_kind}; "
        f"collectives={collectives} (mechanism={mechanism!r}); dtype={cfg.dtype}")
    sharding = NamedSharding(mesh, TOKENS)
    data, losses, times = batches(cfg), [], []
    for step in range(1, steps + 1):
        inputs, targets = (jax.device_put(a, sharding) for a in next(data))
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, inputs, targets)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - start)
        if step % 10 == 0 or step == 1:
            log(f"step {step:4d}  loss {losses[-1]:.4f}")
    if steps > 1:
        log(f"mean step time {1e3 * np.mean(times[1:]):.1f} ms (steps 2-{steps}; step 1 "
            f"with compilation: {times[0]:.1f} s)")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--collectives", choices=("pk", "xla"), default="pk")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    train(args.steps, args.collectives, Config(dtype=args.dtype))


if __name__ == "__main__":
    main()
