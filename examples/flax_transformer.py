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
quickly.

`--collectives xla` is the baseline, the best a JAX user has without pk_jax
(`baseline_attention`): every pk op at mechanism="xla" (XLA's collectives for
the tensor-parallel layers), and for attention cuDNN flash attention when the
sequence is on one rank ("xla+cudnn"), or the cuDNN ring of
benchmarks/baselines/cudnn_ring.py (Transformer Engine's approach) when it is
sharded ("xla+cudnn_ring"). Where cuDNN is unavailable (CPUs, float32) the
baseline is named "xla": XLA's attention, or the pure-JAX ring. The losses of
pk and the baseline agree.

    python examples/flax_transformer.py [--steps 50] [--collectives {pk,xla,both}]
                                        [--fp8 {none,current,delayed,block,current_fast,delayed_fast,block_dyblocks}]

Runs on GPUs unchanged (use --dtype bfloat16 there for the fused kernels) or
on 8 fake CPU devices. `--preset gpu` is a model the fused kernels take (head
dim 128, 8k tokens, bf16), `--preset gpu_llama` a GEMM-heavy one for one GPU
(Llama-3 8B's layer widths, 4 layers, 4096 tokens); `--collectives both
--save` times pk against the baseline and writes the "flax_transformer"
section of benchmarks/RESULTS.md (rows name their baseline). tools/step_breakdown.py profiles one step of
either run and splits its GPU time by op.

`--fp8 current|delayed|block` builds every tensor-parallel projection
(attention's q|k|v and output, the MLP's gate|up and down) with that FP8
recipe (pk_jax.flax's `fp8=`), parameters and everything else as without
(`current_fast`, `delayed_fast`: the recipe with fast_gradient_accumulation;
`block_dyblocks`: block scaling with wgrad_dy_blocks, the weight gradient's
dy^T per 128x128);
"delayed" keeps amax histories, and the training step writes amax(dy) into
them (`pk_jax.flax.update_fp8_state`, see `build`). Block scaling needs
128-multiples (128 rows per device among them): its default preset is
"fp8_block". `--compare-fp8` trains without and with each recipe and
prints the final losses and step times (`--save`: the "flax_fp8" section of
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.flax import (ParallelMLP, RingSelfAttention, init_sharded, shard_size,
                         update_fp8_state)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/ is not a package
from _train_util import (  # noqa: E402
    LMConfig, Trainer, adam_trainer, batches, fake_cpu_devices, largest_relative_difference,
    sharded_lm_loss, train_loop)

fake_cpu_devices(8)  # only affects the CPU backend: 8 fake devices when there is no GPU

TOKENS = P("tp", "sp")  # [batch, seq]: batch over "tp", sequence over "sp"


@dataclasses.dataclass(frozen=True)
class Config(LMConfig):
    """Model, data and optimizer sizes (small defaults: CPU in seconds):
    LMConfig's (vocab, d_model, num_heads, num_layers, batch, seq_len,
    period, learning_rate, dtype) and attention's and the MLP's."""

    num_kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 128


# --fp8: "none", a pk_jax.Fp8Recipe scaling, or "<scaling>_<option>": "_fast"
# (fast_gradient_accumulation: the gradient GEMMs without fp32 promotion),
# "_dyblocks" (wgrad_dy_blocks: the weight gradient's dy^T per 128x128)
FP8 = ("none", "current", "delayed", "block", "current_fast", "delayed_fast", "block_dyblocks")
FP8_OPTIONS = {"fast": "fast_gradient_accumulation", "dyblocks": "wgrad_dy_blocks"}


def fp8_recipe(fp8: str):
    """The pk_jax.Fp8Recipe of an --fp8 name (None for "none")."""
    if fp8 == "none":
        return None
    scaling, _, option = fp8.partition("_")
    return pk_jax.Fp8Recipe(scaling, **({FP8_OPTIONS[option]: True} if option else {}))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x));
    `fp8`: the projections' FP8 recipe (None: none)."""

    def __init__(self, cfg: Config, tp: int, mechanism: str, rngs: nnx.Rngs,
                 attention_fn: Callable | None = None, fp8=None) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = RingSelfAttention(
            shard_size(cfg.num_heads, tp, "num_heads"),
            shard_size(cfg.num_kv_heads, tp, "num_kv_heads"), cfg.head_dim, cfg.d_model,
            axis_name="sp", tp_axis_name="tp", causal=True, dtype=dtype, rngs=rngs,
            mechanism=mechanism, attention_fn=attention_fn, fp8=fp8)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.mlp = ParallelMLP(cfg.d_model, shard_size(cfg.hidden, tp, "hidden"),
                               axis_name="tp", dtype=dtype, rngs=rngs, mechanism=mechanism,
                               fp8=fp8)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """Decoder-only LM; called per shard on tokens [batch / tp, seq / sp].
    `attention_fn` replaces pk_jax.ring_attention in every block (a baseline's
    attention, see `baseline_attention`); None: pk_jax's. `fp8`: the
    tensor-parallel projections' FP8 recipe (None: none)."""

    def __init__(self, cfg: Config, tp: int, mechanism: str, rngs: nnx.Rngs,
                 attention_fn: Callable | None = None, fp8=None) -> None:
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, tp, mechanism, rngs, attention_fn, fp8)
                                for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        s_local = tokens.shape[1]
        positions = lax.axis_index("sp") * s_local + jnp.arange(s_local)  # global positions
        x = self.embed(tokens) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def make_mesh(sp: int | None = None, tp: int | None = None,
              axis_types: AxisType = AxisType.Explicit) -> Mesh:
    """An (sp, tp) mesh over the default devices; tp defaults to 2 where
    the device count is even, sp to the rest. Explicit axes by default, as
    `jax.make_mesh` gives; the model runs the same on Auto axes."""
    n = len(jax.devices())
    tp = tp or (2 if n % 2 == 0 else 1)
    sp = sp or n // tp
    return jax.make_mesh((sp, tp), ("sp", "tp"), axis_types=(axis_types,) * 2,
                         devices=jax.devices()[:sp * tp])


def make_loss(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh,
              state: nnx.State | None = None) -> Callable:
    """loss(params, inputs, targets): mean next-token cross-entropy over the
    global batch, with the model run per shard (tokens laid out as TOKENS).
    The data: `batches(cfg)`, a repeating token pattern (_train_util.py).
    With `state` (FP8 delayed scaling's histories): loss(params, state,
    inputs, targets) -> (loss, state after the forward pass)."""
    return sharded_lm_loss(graphdef, params, mesh, TOKENS, state)


# Model sizes by name: "small" trains in seconds on CPU; "gpu" is shaped for
# the fused kernels (bf16, head dim 128, S_local a multiple of 128);
# "fp8_block" is "small" in the 128-multiples FP8 block scaling needs (128
# token rows per device on the default sp=4 x tp=2 mesh of 8 devices).
PRESETS = {
    "small": Config(),
    "fp8_block": Config(d_model=128, head_dim=64, hidden=256, seq_len=128),
    "gpu": Config(vocab=8192, d_model=2048, num_heads=16, num_kv_heads=4, head_dim=128,
                  hidden=8192, num_layers=4, batch=4, seq_len=8192, period=64,
                  dtype="bfloat16"),
    # GEMM-heavy, one GPU: Llama-3 8B's layer widths (d_model 4096, MLP 14336,
    # 32 query / 8 KV heads of 128), 4 layers, 4096 tokens a step (the FP8 runs);
    # Adam at 3e-4 (at the default 3e-3 its 200-step runs were unstable); 10% of
    # the targets random, so the loss levels off near 1.23 instead of reaching
    # zero and the recipes' losses compare (benchmarks/NOTES.md, 2026-12-06)
    "gpu_llama": Config(vocab=8192, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        hidden=14336, num_layers=4, batch=1, seq_len=4096, period=64,
                        label_noise=0.1, learning_rate=3e-4, dtype="bfloat16"),
}
GPU_PRESETS = ("gpu", "gpu_llama")


# ---- the baseline: XLA's collectives, cuDNN attention ---------------------------
@dataclasses.dataclass(frozen=True)
class Attention:
    """How a run computes attention: `name` (the baseline's name in results,
    e.g. "xla+cudnn"), `fn` (RingSelfAttention's attention_fn; None:
    pk_jax.ring_attention with the run's mechanism) and `note` (what it is,
    or why cuDNN is not used)."""

    name: str
    fn: Callable | None
    note: str


def _cudnn_problem(cfg: Config, mesh: Mesh) -> str | None:
    """Why cuDNN flash attention does not take this model's per-shard
    attention (sequence on one rank), or None: checked by compiling its
    forward and backward on the shard's shape on one device."""
    if mesh.devices.flat[0].platform != "gpu":
        return f"no GPU (platform {mesh.devices.flat[0].platform}): cuDNN attention needs one"
    if cfg.dtype not in ("bfloat16", "float16"):
        return f"dtype {cfg.dtype} (cuDNN flash attention takes bfloat16 or float16)"
    tp, dtype = mesh.shape["tp"], jnp.dtype(cfg.dtype)
    q = jax.ShapeDtypeStruct((cfg.batch // tp, cfg.seq_len, cfg.num_heads // tp, cfg.head_dim),
                             dtype)
    k = jax.ShapeDtypeStruct(q.shape[:2] + (cfg.num_kv_heads // tp, cfg.head_dim), dtype)
    loss = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()
    try:
        jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k).compile()
    except Exception as e:  # noqa: BLE001 - any failure: cuDNN does not take this shape here
        return (f"cuDNN attention does not take q {q.shape} / kv {k.shape}: "
                f"{_cudnn_ring_module().first_line(e)}")
    return None


def _cudnn_attention(q, k, v, axis_name, *, causal: bool, layout: str):
    del axis_name, layout  # the sequence is on one rank
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _xla_attention(q, k, v, axis_name, *, causal: bool, layout: str):
    del axis_name, layout
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def _cudnn_ring_module():
    """benchmarks/baselines/cudnn_ring.py, loaded from its file (benchmarks/
    is not an installed package)."""
    name = "flax_transformer_cudnn_ring"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                            "baselines", "cudnn_ring.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look the module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def baseline_attention(cfg: Config, mesh: Mesh, blocks=None) -> Attention:
    """The attention of the baseline run: the best a JAX user has without
    pk_jax. Sequence on one rank (sp = 1): cuDNN flash attention
    (`jax.nn.dot_product_attention(implementation="cudnn")`) where cuDNN
    takes the shape, else XLA's attention. Sequence sharded (sp > 1): the
    cuDNN ring (benchmarks/baselines/cudnn_ring.py: Transformer Engine's
    approach, ppermute hops between cuDNN blocks merged by log-sum-exp, and
    its backward ring), else pk_jax's pure-JAX ring. `blocks`: the ring's
    block attention (default: cuDNN's, probed; `cudnn_ring.einsum_blocks()`
    runs the ring's code on CPUs)."""
    if mesh.shape["sp"] == 1:
        why = _cudnn_problem(cfg, mesh)
        if why is None:
            return Attention("xla+cudnn", _cudnn_attention, "cuDNN flash attention")
        return Attention("xla", _xla_attention, f"XLA's dot_product_attention ({why})")
    cudnn_ring = _cudnn_ring_module()
    if blocks is None:
        try:
            blocks = cudnn_ring.cudnn_blocks()
        except cudnn_ring.Unavailable as e:
            return Attention("xla", None, f"pk_jax's pure-JAX ppermute ring (no cuDNN ring: {e})")
    if blocks.bwd is None:
        return Attention("xla", None, f"pk_jax's pure-JAX ppermute ring (the cuDNN ring has "
                                      f"no backward here: {blocks.bwd_note})")

    def ring(q, k, v, axis_name, *, causal: bool, layout: str):
        return cudnn_ring.ring_attention(q, k, v, axis_name, causal=causal, layout=layout,
                                         blocks=blocks)
    name = "cudnn_ring" if blocks.name == "cudnn" else "ring_" + blocks.name.split()[0]
    return Attention("xla+" + name, ring, f"{blocks.name} ring (Transformer Engine's approach; "
                                          f"{blocks.note})")


# ---- training (the loop and the Adam step: _train_util.py) -------------------
def build(collectives: str, cfg: Config, mesh: Mesh,
          attention: Attention | None = None, fp8: str = "none") -> Trainer:
    """The training step of `collectives`: "pk" (every pk_jax op at
    mechanism "auto") or "xla" (the baseline: XLA's collectives for the
    tensor-parallel layers, `attention` for attention, by default
    `baseline_attention(cfg, mesh)`). Call it inside `jax.set_mesh(mesh)`.

    fp8 (one of FP8; "pk" only): the tensor-parallel projections' recipe.
    With "delayed" the model's amax histories (every variable that is not
    an nnx.Param) travel beside the parameters: the loss returns them as the
    forward pass left them (the amaxes of x and w recorded), the step
    differentiates with respect to them too (the dy histories' gradients
    carry amax(dy)) and `update_fp8_state` writes those in; Adam sees the
    parameters only."""
    sp, tp = mesh.shape["sp"], mesh.shape["tp"]
    shard_size(cfg.batch, tp, "batch")
    shard_size(cfg.seq_len, sp, "seq_len")
    if fp8 not in FP8:
        raise ValueError(f"fp8 must be one of {FP8}, got {fp8!r}")
    if fp8 != "none" and collectives != "pk":
        raise ValueError(f"fp8={fp8!r} runs pk_jax's FP8 ops: collectives='pk', not "
                         f"{collectives!r}")
    mechanism = {"pk": "auto", "xla": "xla"}[collectives]
    if collectives == "pk":
        attention = Attention("pk", None, "pk_jax.ring_attention")
    elif attention is None:
        attention = baseline_attention(cfg, mesh)
    recipe = fp8_recipe(fp8)
    graphdef, params = init_sharded(
        lambda: Transformer(cfg, tp, mechanism, nnx.Rngs(0), attention.fn, recipe), mesh)
    params, state = nnx.split_state(params, nnx.Param, ...)
    description = (f"mesh sp={sp} x tp={tp} on {mesh.devices.flat[0].device_kind}; "
                   f"collectives={collectives} (mechanism={mechanism!r}, attention: "
                   f"{attention.name}, {attention.note}); dtype={cfg.dtype}; fp8={fp8}")
    if not jax.tree.leaves(state):  # no FP8, or a recipe without state
        return adam_trainer(make_loss(graphdef, params, mesh), params, cfg.learning_rate,
                            NamedSharding(mesh, TOKENS), description)
    return adam_trainer(make_loss(graphdef, params, mesh, state), params, cfg.learning_rate,
                        NamedSharding(mesh, TOKENS), description, state, update_fp8_state)


def train(steps: int = 50, collectives: str = "pk", cfg: Config = Config(),
          mesh: Mesh | None = None, log: Callable[[str], None] = print,
          attention: Attention | None = None, fp8: str = "none") -> list[float]:
    """Train `steps` Adam steps; returns the loss of every step."""
    return train_timed(steps, collectives, cfg, mesh, log, attention, fp8)[0]


def train_timed(steps: int, collectives: str, cfg: Config, mesh: Mesh | None = None,
                log: Callable[[str], None] = print, attention: Attention | None = None,
                fp8: str = "none") -> tuple[list[float], float]:
    """Train `steps` Adam steps; (loss of every step, mean step time in ms
    over steps 2.. (step 1 compiles); nan with one step). `attention`: the
    baseline's attention (collectives "xla"; default `baseline_attention`);
    fp8: `build`'s."""
    mesh = mesh or make_mesh()
    with jax.set_mesh(mesh):  # explicit sharding: jit's outputs live on this mesh
        trainer = build(collectives, cfg, mesh, attention, fp8)
        return train_loop(steps, trainer, batches(cfg), log, statistic="mean")


def fp8_recipes_for(cfg: Config, mesh: Mesh) -> tuple[str, ...]:
    """The FP8 recipes this model takes on this mesh (FP8's order): "current"
    and "delayed" (and their "_fast" forms) need 16-multiples, "block" (and
    "block_dyblocks") 128-multiples, of d_model, the
    per-device q|k|v and output widths, the per-device hidden size and the
    token rows per device."""
    sp, tp = mesh.shape["sp"], mesh.shape["tp"]
    sizes = (cfg.d_model, (cfg.num_heads + 2 * cfg.num_kv_heads) // tp * cfg.head_dim,
             cfg.num_heads // tp * cfg.head_dim, cfg.hidden // tp,
             cfg.batch // tp * (cfg.seq_len // sp))
    multiple = {"current": 16, "delayed": 16, "block": 128}
    return tuple(r for r in FP8[1:]
                 if all(size % multiple[fp8_recipe(r).scaling] == 0 for size in sizes))


def compare_fp8(steps: int, cfg: Config, mesh: Mesh, recipes=FP8[1:],
                log: Callable[[str], None] = print, save: bool = False,
                command: str = "") -> dict[str, list[float]]:
    """Train `steps` steps without FP8 and with each recipe (pk's
    collectives, the same data and initial weights); return each run's
    losses and print, for each recipe, its final loss and the mean of its
    loss curve, each relative to the run without FP8 (the accuracy target:
    the final loss within 2% after 200 steps, benchmarks/NOTES.md), and the
    mean step times. `save`: the "flax_fp8" section of benchmarks/RESULTS.md."""
    runs = {fp8: train_timed(steps, "pk", cfg, mesh, log=lambda line: None, fp8=fp8)
            for fp8 in ("none", *recipes)}
    base, base_ms = runs["none"]
    rows = []
    for fp8, (run, ms) in runs.items():
        final, curve = ((run[-1] - base[-1]) / base[-1],
                        (np.mean(run) - np.mean(base)) / np.mean(base))
        diff = "" if fp8 == "none" else f"  ({final:+.2%}; curve mean {curve:+.2%})"
        log(f"fp8={fp8:8s} loss after {steps} steps {run[-1]:.4f}{diff}; "
            f"step {ms:.1f} ms ({base_ms / ms:.2f}x without FP8)")
        rows.append(dict(implementation="bf16" if fp8 == "none" else f"fp8_{fp8}",
                         median_ms=ms, vs_bf16=base_ms / ms, final_loss=run[-1],
                         final_loss_vs_bf16=final, curve_mean_vs_bf16=curve, steps=steps,
                         config=dataclasses.asdict(cfg), sp=mesh.shape["sp"],
                         tp=mesh.shape["tp"]))
    if save:
        markdown_table, write_results = _results_writers()
        table = markdown_table(
            ["run", "ms/step", "vs bf16", f"loss after {steps} steps", "vs bf16",
             "curve mean vs bf16"],
            [[r["implementation"], f"{r['median_ms']:.1f}", f"{r['vs_bf16']:.2f}x",
              f"{r['final_loss']:.4f}", f"{r['final_loss_vs_bf16']:+.2%}",
              f"{r['curve_mean_vs_bf16']:+.2%}"] for r in rows])
        write_results("flax_fp8", rows,
                      f"Training steps of examples/flax_transformer.py ({_shape(cfg, mesh)}) "
                      f"without FP8 (`bf16`: every projection pk's op at mechanism='auto', "
                      f"bfloat16) and with each FP8 recipe on every projection (pk_jax.flax's "
                      f"fp8=); the same data and initial weights; mean step time over steps "
                      f"2-{steps}.\n\n{table}", command)
    return {fp8: run for fp8, (run, _) in runs.items()}


def _results_writers():
    """benchmarks/common.py's (markdown_table, write_results)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "benchmarks"))
    from common import markdown_table, write_results
    return markdown_table, write_results


def _shape(cfg: Config, mesh: Mesh) -> str:
    return (f"d_model {cfg.d_model}, {cfg.num_layers} layers, heads {cfg.num_heads}/"
            f"{cfg.num_kv_heads} x {cfg.head_dim}, hidden {cfg.hidden}, batch {cfg.batch} x "
            f"{cfg.seq_len} tokens, {cfg.dtype}, mesh sp={mesh.shape['sp']} x "
            f"tp={mesh.shape['tp']}")


def compare(steps: int, cfg: Config, mesh: Mesh, save: bool, command: str,
            attention: Attention | None = None) -> None:
    """Train with pk and with the baseline (XLA's collectives, cuDNN
    attention where it applies: `baseline_attention`); print (and with
    `save` record) the step times and whether the losses agree."""
    attention = attention or baseline_attention(cfg, mesh)
    runs = {c: train_timed(steps, c, cfg, mesh, attention=attention) for c in ("pk", "xla")}
    (pk_loss, pk_ms), (xla_loss, xla_ms) = runs["pk"], runs["xla"]
    base = attention.name
    agree = largest_relative_difference(pk_loss, xla_loss)
    print(f"step time: pk {pk_ms:.1f} ms, baseline {base} {xla_ms:.1f} ms: "
          f"{xla_ms / pk_ms:.2f}x; largest relative loss difference {agree:.1e}")
    if not save:
        return
    markdown_table, write_results = _results_writers()
    shape = _shape(cfg, mesh)
    rows = [dict(implementation=name, median_ms=ms, steps=steps, final_loss=runs[c][0][-1],
                 baseline=base, baseline_median_ms=xla_ms, baseline_note=attention.note,
                 vs_baseline=xla_ms / ms, config=dataclasses.asdict(cfg), sp=mesh.shape["sp"],
                 tp=mesh.shape["tp"])
            for c, name, ms in (("pk", "pk", pk_ms), ("xla", base, xla_ms))]
    table = markdown_table(["run", "ms/step", f"vs {base}", "final loss"],
                           [[r["implementation"], f"{r['median_ms']:.1f}",
                             f"{r['vs_baseline']:.2f}x", f"{r['final_loss']:.4f}"]
                            for r in rows])
    write_results("flax_transformer", rows,
                  f"Training step of examples/flax_transformer.py ({shape}); mean over "
                  f"steps 2-{steps}. Baseline `{base}`: the same model with XLA's "
                  f"collectives for the tensor-parallel layers (every pk op at "
                  f"mechanism='xla') and, for attention, {attention.note}. pk: every pk op "
                  f"at mechanism='auto'. Losses of the two runs agree to {agree:.1e}.\n\n"
                  f"{table}",
                  command)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and mesh options (shared with tools/step_breakdown.py)."""
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help="model sizes (default: small; fp8_block with --fp8 block)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="computation dtype (default: the preset's)")
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel size")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size")


def model_from_arguments(args: argparse.Namespace,
                         parser: argparse.ArgumentParser) -> tuple[Config, Mesh]:
    """(config, mesh) of the options `add_model_arguments` added."""
    preset = args.preset or ("fp8_block" if getattr(args, "fp8", "none") == "block" else "small")
    cfg = PRESETS[preset]
    if preset in GPU_PRESETS and jax.devices()[0].platform != "gpu":
        parser.error(f"--preset {preset} is a model for GPUs (hundreds of millions of "
                     "parameters, thousands of tokens per step: tens of GiB on the host); "
                     "this machine has no GPU, use the default preset")
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    return cfg, make_mesh(args.sp, args.tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--collectives", choices=("pk", "xla", "both"), default="pk",
                        help="pk: pk_jax's ops; xla: the baseline (XLA's collectives, cuDNN "
                             "attention or the cuDNN ring where cuDNN takes the shapes); "
                             "both: time the two")
    add_model_arguments(parser)
    parser.add_argument("--fp8", choices=FP8, default="none",
                        help="FP8 recipe of the tensor-parallel projections (pk only)")
    parser.add_argument("--compare-fp8", action="store_true",
                        help="train without FP8 and with each recipe that the model's sizes "
                             "take; print the final losses")
    parser.add_argument("--save", action="store_true",
                        help="with --collectives both or --compare-fp8: write "
                             "benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.fp8 != "none" and args.collectives != "pk":
        parser.error("--fp8 runs pk_jax's FP8 ops: use it with --collectives pk")
    cfg, mesh = model_from_arguments(args, parser)
    command = "python examples/flax_transformer.py " + " ".join(sys.argv[1:])
    if args.compare_fp8:
        compare_fp8(args.steps, cfg, mesh, fp8_recipes_for(cfg, mesh), save=args.save,
                    command=command)
    elif args.collectives == "both":
        compare(args.steps, cfg, mesh, args.save, command)
    else:
        train(args.steps, args.collectives, cfg, mesh, fp8=args.fp8)


if __name__ == "__main__":
    main()
