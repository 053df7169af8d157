"""Training plumbing the examples share (flax_transformer.py, moe.py): fake
CPU devices, the synthetic data, the per-shard loss, a jitted Adam step and
the timed training loop. Each example keeps its own model, mesh and
baseline; only what is the same in both lives here.

examples/ is not a package: an example puts its own folder on sys.path and
imports this file (`import _train_util`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.flax import partition_specs


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The sizes every example's language model has (defaults: CPU in
    seconds); an example's Config adds its own fields and defaults."""

    vocab: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    batch: int = 8
    seq_len: int = 64
    period: int = 16  # length of the repeating token pattern (`batches`)
    label_noise: float = 0.0  # fraction of targets replaced by random tokens (`batches`)
    learning_rate: float = 3e-3
    dtype: str = "float32"  # computation dtype; parameters stay float32


def fake_cpu_devices(count: int = 8) -> None:
    """Ask XLA's CPU backend for `count` fake devices (only affects the CPU
    backend; call before the first jax.devices()). Also keeps NCCL off NVLink
    multicast, which pk_jax never uses."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever


def batches(cfg: LMConfig, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (inputs, targets) [cfg.batch, cfg.seq_len] int32: one fixed
    pattern of `cfg.period` distinct tokens (of cfg.vocab), repeating from a
    random offset per row, so the next token follows from the current one.
    With cfg.label_noise = p each target is a uniformly random token with
    probability p: the loss then has a floor (about -(1 - p) ln(1 - p) +
    p ln(vocab / p)) instead of falling to zero, so runs stay comparable."""
    rng = np.random.default_rng(seed)
    pattern = rng.permutation(cfg.vocab)[:cfg.period]
    while True:
        offsets = rng.integers(cfg.period, size=(cfg.batch, 1))
        tokens = pattern[(offsets + np.arange(cfg.seq_len + 1)) % cfg.period].astype(np.int32)
        targets = tokens[:, 1:]
        if cfg.label_noise:
            noisy = rng.random(targets.shape) < cfg.label_noise
            targets = np.where(noisy, rng.integers(cfg.vocab, size=targets.shape),
                               targets).astype(np.int32)
        yield tokens[:, :-1], targets


def sharded_lm_loss(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh,
                    tokens: P, state: nnx.State | None = None) -> Callable:
    """loss(params, inputs, targets): mean next-token cross-entropy over the
    global batch, with the model (graphdef, params) run per shard on tokens
    laid out as `tokens`. With `state` (the model's variables that are not
    parameters, which its forward pass updates: FP8 amax histories):
    loss(params, state, inputs, targets) -> (loss, the state after the
    forward pass)."""
    stateful = state is not None
    state_specs = (partition_specs(state),) if stateful else ()

    @jax.shard_map(mesh=mesh, in_specs=(partition_specs(params), *state_specs, tokens, tokens),
                   out_specs=(P(tuple(mesh.axis_names)), *state_specs))
    def per_shard(params, *args):
        *state, inputs, targets = args
        model = nnx.merge(graphdef, params, *state)
        logits = model(inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()[None]
        return (loss, nnx.state(model, nnx.Not(nnx.Param))) if stateful else (loss,)

    def loss(params, *args):
        out = per_shard(params, *args)
        # Every shard holds as many tokens: the mean of the shard means is the mean.
        return (out[0].mean(), out[1]) if stateful else out[0].mean()

    return loss


@dataclasses.dataclass
class Trainer:
    """One run's jitted Adam step and its state: `step(inputs, targets)`
    trains one step on batches already on the mesh (`put`) and returns the
    loss (not waited for)."""

    train_step: Callable
    params: Any
    opt_state: Any
    sharding: NamedSharding
    description: str

    def put(self, inputs, targets):
        """The batch on the mesh (tokens [batch, seq] laid out as `sharding`)."""
        return tuple(jax.device_put(a, self.sharding) for a in (inputs, targets))

    def step(self, inputs, targets) -> jax.Array:
        self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state,
                                                            inputs, targets)
        return loss


def adam_trainer(loss_fn: Callable, params: Any, learning_rate: float,
                 sharding: NamedSharding, description: str, state: Any = None,
                 update_state: Callable | None = None) -> Trainer:
    """A Trainer of Adam on loss_fn(params, inputs, targets), from `params`.

    With `state` (variables that are not trained: `sharded_lm_loss`'s):
    loss_fn(params, state, inputs, targets) -> (loss, state after the
    forward pass); the step differentiates with respect to the state too
    and sets it to update_state(state after the forward, its gradient)
    (pk_jax.flax.update_fp8_state: amax(dy) into FP8 delayed scaling's
    histories). The Trainer's params are then (params, state)."""
    tx = optax.adam(learning_rate)
    opt_state = jax.jit(tx.init)(params)

    def adam(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        params, opt_state = adam(params, grads, opt_state)
        return params, opt_state, loss

    @jax.jit
    def stateful_step(carry, opt_state, inputs, targets):
        params, state = carry
        (loss, after), (grads, state_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(params, state, inputs, targets)
        params, opt_state = adam(params, grads, opt_state)
        return (params, update_state(after, state_grads)), opt_state, loss

    if state is None:
        return Trainer(train_step, params, opt_state, sharding, description)
    return Trainer(stateful_step, (params, state), opt_state, sharding, description)


def train_loop(steps: int, trainer: Trainer, data: Iterator, log: Callable[[str], None],
               statistic: str = "mean") -> tuple[list[float], float]:
    """Train `steps` steps on `data`; (loss of every step, the `statistic`
    ("mean" or "median") of the step times in ms over steps 2.. (step 1
    compiles); nan with one step).

    Each step is dispatched before the previous step's loss is read (JAX's
    asynchronous dispatch, as a training loop that logs without waiting
    runs): the host's work for a step (its batch, the call's arguments)
    overlaps the device's previous step. A step's time runs from the
    previous step's loss being ready to its own (the first: from its
    dispatch, compilation included)."""
    log(trainer.description)
    losses, times = [], []
    pending, start = None, time.perf_counter()
    for step in range(1, steps + 2):
        loss = trainer.step(*trainer.put(*next(data))) if step <= steps else None
        if pending is not None:  # the previous step's loss: waits for that step only
            losses.append(float(pending))
            now = time.perf_counter()
            times.append(now - start)
            start, done = now, step - 1
            if done % 10 == 0 or done == 1:
                # A wait for a peer GPU that gave up poisons the outputs (NaN) and is
                # raised here, before a poisoned loss is trusted.
                pk_jax.check_errors()
                log(f"step {done:4d}  loss {losses[-1]:.4f}")
        pending = loss
    reduce = {"mean": np.mean, "median": np.median}[statistic]
    step_ms = float(1e3 * reduce(times[1:])) if steps > 1 else float("nan")
    if steps > 1:
        log(f"{statistic} step time {step_ms:.1f} ms (steps 2-{steps}; step 1 "
            f"with compilation: {times[0]:.1f} s)")
    return losses, step_ms


def largest_relative_difference(losses: list[float], reference: list[float]) -> float:
    """max |losses - reference| / max(|reference|, 1e-6): how closely two runs agree."""
    a, b = np.array(losses), np.array(reference)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))
