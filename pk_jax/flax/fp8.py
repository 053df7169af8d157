"""FP8 in pk_jax.flax's layers: the `fp8=` argument, delayed scaling's
state, and the update that brings dy's amax into it.

Recipes (`pk_jax.Fp8Recipe`, or its scaling name): "current" and "block"
keep no state: each call scales from its own operands (pk_jax's FP8 TP ops,
or `pk_jax.fp8_dot` where a layer has no axis). "delayed" (Transformer
Engine's recipe) quantizes with scales from amax histories that the layer
keeps, one `Fp8Scaling` per FP8 matmul, holding three histories of length
`recipe.amax_history_len` (most recent first, zeros at the start):

  * `x`, `kernel` (`Fp8AmaxHistory`): the forward pass records amax(x) and
    amax(w) of each call (an NNX state update inside the call);
  * `grad` (`Fp8GradAmaxHistory`): amax(dy) is known only in the backward
    pass. The matmul takes the scale this history gives as its dy scale,
    whose cotangent is amax(dy) (`pk_jax.fp8_dot`, the TP ops'
    `fp8_scales`); that cotangent becomes the history's gradient (in slot
    0, zeros elsewhere), and `update_fp8_state(model, grads)` rolls each dy
    history and writes it in.

The scale of a history: fp8_max * 2^-margin / amax, with amax its maximum
(`amax_compute_algo="max"`) or its most recent entry ("most_recent"); 1
while that amax is 0 (the first step quantizes with scale 1, as Transformer
Engine's). Inside shard_map the histories are replicated (spec P()) and
every amax recorded is the maximum over all devices (the TP ops' and
`fp8_dot`'s amaxes take their scales' type), so all devices keep one
history; this needs shard_map's check_vma (the default).

flax.linen's FP8 ops carry the same values in variables of the
`_overwrite_with_gradient` collection, whose "gradients" are the new
values and which `TrainState.apply_gradients` writes over the old ones. The
NNX form here: the histories are variables of their own types (not
`nnx.Param`, so `nnx.Optimizer(model, tx, wrt=nnx.Param)` does not train
them), the gradient is taken with respect to `fp8_wrt()` (the parameters
and the dy histories), and one call applies it:

    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, fp8_wrt()))(model, x, y)
        optimizer.update(model, grads)      # reads the nnx.Param entries only
        update_fp8_state(model, grads)      # amax(dy) into the dy histories

(the forward pass under nnx.grad already updated the x and w histories).
With a graphdef and a state (e.g. a model run per shard inside shard_map),
return the histories after the forward pass from the loss (`nnx.state(model,
Fp8AmaxHistory)`), differentiate with respect to them too, and call
`update_fp8_state(histories_after, their_grads)`, which returns the new
state (examples/flax_transformer.py does this).

A layer with delayed scaling is meant to be called once per training step:
each call rolls the x and w histories, and the dy gradients of several
calls add up (an amax above the true one: a smaller scale, never an
overflow).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pk_jax.flax._common import SPEC_KEY
from pk_jax.ops.fp8 import api as fp8_ops
from pk_jax.ops.fp8 import Fp8Recipe
from pk_jax.ops.fp8.primitive import IN_TYPES as QUANTIZED_DTYPES  # what quantization reads


class Fp8AmaxHistory(nnx.Variable):
    """An amax history of an FP8 matmul's input or kernel (delayed scaling),
    [amax_history_len] float32, most recent first; the forward records it.
    Not an `nnx.Param`: optimizers built with wrt=nnx.Param leave it alone."""


class Fp8GradAmaxHistory(Fp8AmaxHistory):
    """The amax history of an FP8 matmul's output gradient dy (delayed
    scaling). Its gradient holds amax(dy) in slot 0: `update_fp8_state`
    writes it in (take gradients with respect to `fp8_wrt()`)."""


def fp8_wrt(wrt=nnx.Param):
    """The variables to differentiate in a training step with FP8 delayed
    scaling: `wrt` (the parameters) and the dy amax histories, whose
    gradients `update_fp8_state` reads (use as nnx.DiffState(0, fp8_wrt()))."""
    return nnx.Any(wrt, Fp8GradAmaxHistory)


def fp8_recipe(fp8, where: str) -> Fp8Recipe | None:
    """A layer's `fp8=` argument as an Fp8Recipe (None: no FP8); errors name
    the argument and the layer (`where`)."""
    if fp8 is None or isinstance(fp8, Fp8Recipe):
        return fp8
    if not isinstance(fp8, str):
        raise TypeError(f"{where}: fp8 must be None, a pk_jax.Fp8Recipe or one of "
                        f"{fp8_ops._RECIPES}, got {fp8!r}")
    if fp8 not in fp8_ops._RECIPES:
        raise ValueError(f"{where}: fp8 must be None, a pk_jax.Fp8Recipe or one of "
                         f"{fp8_ops._RECIPES}, got {fp8!r}")
    return Fp8Recipe(scaling=fp8)


def check_fp8(where: str, recipe: Fp8Recipe | None, mechanism: str, **sizes: int) -> None:
    """What an FP8 layer needs at construction: mechanism "auto" (the FP8
    path picks its own) and every contraction / output size in `sizes` a
    multiple of 16 (128 with block scaling), each named in the error. The
    rows per device (16, 128) are checked by the ops at the call."""
    if recipe is None:
        return
    if mechanism != "auto":
        raise ValueError(f"{where}: with fp8 the mechanism must be 'auto' (the FP8 path picks "
                         f"its own), got {mechanism!r}")
    mult = 128 if recipe.scaling == "block" else 16
    for name, size in sizes.items():
        if size % mult:
            raise ValueError(f"{where}(fp8={recipe.scaling!r}): {name} ({size}) must be a "
                             f"multiple of {mult}")


def history_scale(history: jax.Array, dtype, recipe: Fp8Recipe) -> jax.Array:
    """The scale [1] a history gives (the module docstring)."""
    amax = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    return fp8_ops.scale_from_amax(amax, dtype, recipe.margin).reshape(1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_scale(history: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    """dy's scale from its history; the scale's cotangent (amax(dy), from
    the FP8 matmul) comes back as the history's gradient, in slot 0."""
    return history_scale(history, recipe.bwd_dtype, recipe)


def _grad_scale_fwd(history, recipe):
    return _grad_scale(history, recipe), jnp.zeros_like(history)


def _grad_scale_bwd(recipe, zeros, ct):
    return (zeros.at[0].set(ct.reshape(())),)


_grad_scale.defvjp(_grad_scale_fwd, _grad_scale_bwd)


def _rolled(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history with `amax` as its most recent entry (the oldest drops)."""
    return jnp.concatenate([amax.reshape(1).astype(history.dtype), history[:-1]])


def _history(cls, recipe: Fp8Recipe) -> Fp8AmaxHistory:
    return cls(jnp.zeros((recipe.amax_history_len,), jnp.float32), **{SPEC_KEY: P()})


class Fp8Scaling(nnx.Module):
    """Delayed scaling's state of one FP8 matmul: the amax histories of its
    input (`x`), its kernel (`kernel`) and its output gradient (`grad`),
    replicated over the mesh (the module docstring)."""

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.x = _history(Fp8AmaxHistory, recipe)
        self.kernel = _history(Fp8AmaxHistory, recipe)
        self.grad = _history(Fp8GradAmaxHistory, recipe)

    def scales(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(x_scale, w_scale, dy_scale) for the matmul; only dy's is
        differentiated (into its history)."""
        r = self.recipe
        return (history_scale(jax.lax.stop_gradient(self.x[...]), r.fwd_dtype, r),
                history_scale(jax.lax.stop_gradient(self.kernel[...]), r.fwd_dtype, r),
                _grad_scale(self.grad[...], r))

    def record(self, amaxes: tuple[jax.Array, jax.Array]) -> None:
        """Record a call's (amax(x), amax(w))."""
        ax, aw = (jax.lax.stop_gradient(a) for a in amaxes)
        self.x[...] = _rolled(self.x[...], ax)
        self.kernel[...] = _rolled(self.kernel[...], aw)


def fp8_project(x: jax.Array, kernel: jax.Array, axis_name, recipe: Fp8Recipe,
                scaling: Fp8Scaling | None, op: Callable) -> jax.Array:
    """`op(x, kernel, axis_name, fp8=recipe)` (a pk_jax TP matmul; axis_name
    None: pk_jax.fp8_dot) with x's dtype as the result's (the kernel may be
    the float32 parameter); with delayed scaling the scales come from
    `scaling` and the call's amaxes are recorded there."""
    scales = None if scaling is None else scaling.scales()
    if axis_name is None:
        out = fp8_ops.fp8_dot(x, kernel, recipe, scales=scales, out_dtype=x.dtype)
    else:
        out = op(x, kernel, axis_name, fp8=recipe, fp8_scales=scales,
                 preferred_element_type=x.dtype)
    if scaling is None:
        return out
    y, amaxes = out
    scaling.record(amaxes)
    return y


def split_columns(y: jax.Array, widths) -> list[jax.Array]:
    """y [..., sum(widths)] split along its last dim."""
    return jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)


def update_fp8_state(model, grads):
    """Record amax(dy) of a training step in every dy amax history
    (`Fp8GradAmaxHistory`) of `model`: each history rolls by one and takes
    the value in slot 0 of its gradient in `grads` (the module docstring).

    model: an nnx.Module (updated in place; returns None) or an nnx.State
      (returns the updated State; entries of other types unchanged).
    grads: an nnx.State of gradients with the same paths, holding the dy
      histories' (take them with respect to `fp8_wrt()`). A ValueError
      names a dy history that has none.
    """
    module = isinstance(model, nnx.Module)
    state = nnx.state(model, Fp8GradAmaxHistory) if module else model
    if not isinstance(state, nnx.State):
        raise TypeError(f"pk_jax.flax.update_fp8_state: model must be an nnx.Module or an "
                        f"nnx.State, got {type(model).__name__}")
    if not isinstance(grads, nnx.State):
        raise TypeError(f"pk_jax.flax.update_fp8_state: grads must be an nnx.State (from "
                        f"nnx.grad or jax.grad of a state), got {type(grads).__name__}")
    flat_grads = dict(nnx.to_flat_state(grads))
    updated = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, Fp8GradAmaxHistory):
            if path not in flat_grads:
                raise ValueError(
                    f"pk_jax.flax.update_fp8_state: grads hold no gradient for the dy amax "
                    f"history {'.'.join(map(str, path))}; differentiate with respect to "
                    f"pk_jax.flax.fp8_wrt() (nnx.DiffState(0, fp8_wrt()) with nnx.grad), or "
                    f"with respect to the Fp8GradAmaxHistory variables of a state")
            g = flat_grads[path]
            g = g[...] if isinstance(g, nnx.Variable) else jnp.asarray(g)
            var = var.replace(_rolled(var[...], g[0]))
        updated.append((path, var))
    new = nnx.from_flat_state(updated)
    if module:
        nnx.update(model, new)
        return None
    return new
