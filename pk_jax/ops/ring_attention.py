"""pk_jax.ring_attention: sequence-parallel attention over a mesh axis.

Every device of `axis_name` holds a slice of the sequence (q, k and v of the
same tokens); the result equals attention over the whole sequence.

Causal masks use global token positions, computed from the rank and the
layout, so both layouts are exact:
  * "contiguous": rank r holds tokens [r * S_local, (r + 1) * S_local).
  * "zigzag": the sequence is cut into 2n chunks of S_local / 2 tokens and
    rank r holds chunks r and 2n - 1 - r, so every rank has the same causal
    work. `zigzag_shard` / `zigzag_unshard` reorder global arrays to and from
    this layout.

Mechanisms:
  * "copy_engine": the fused kernel (csrc/kernels/ring_attention): the copy
    engines push this rank's K/V block to every peer while one attention
    kernel walks its own block and then each peer's block as it lands,
    merging all steps in registers. bfloat16/float16, head_dim 64 or 128,
    S_local a multiple of 128 (256 for zigzag). On platforms other than CUDA
    it lowers to the reference.
  * "ld_st": the same fused kernel and shapes, with `num_comm_ctas`
    (default 16) communicator CTAs of its own launched first: they push the
    K/V block to the peers with 16-byte loads/stores over NVLink while the
    other SMs attend (no copy engines, no side streams).
  * "xla": the pure-JAX ring (ring_attention_reference.py): ppermute of K/V
    blocks with an fp32 online softmax, O(S_local) memory. On a ring of one
    without return_lse: jax.nn.dot_product_attention (XLA's attention).
  * "auto": the kernel mechanism of pk_jax/tuning.py's measured table
    (today "copy_engine" everywhere) where the kernel applies, else "xla"
    (with a one-time PkJaxFallbackWarning saying why).
Gradients: a custom_vjp saving the output and log-sum-exp; the backward is a
ring (ring_attention_reference.ring_reference_bwd: K/V blocks travel with their
partial dK/dV and go home at the end, dq stays local, probabilities recomputed
from the log-sum-exp, fixed summation order). For the kernel mechanisms each
step's block gradients are one Hopper flash-attention backward kernel
(attention_bwd_primitive.py); the hops between steps are XLA collective
permutes, scheduled to fly while the kernels run. A backward whose transfers
are fused into the kernel is future work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import groups, runtime, tuning
from pk_jax._compat import make_varying
from pk_jax._warnings import warn_once
from pk_jax.ops.ring_attention_primitive import (DEFAULT_COMM_CTAS, KERNEL_MECHANISMS,
                                                 MAX_COMM_CTAS, fused_forward, kernel_problem)
from pk_jax.ops.ring_attention_reference import RingConfig, ring_reference, ring_reference_bwd

MECHANISMS = ("auto", "copy_engine", "ld_st", "xla")
LAYOUTS = ("contiguous", "zigzag")


def check_qkv_arrays(op: str, seq: str, q, k, v) -> None:
    """q, k, v are rank-4 [batch, `seq`, heads, head_dim] floating-point arrays
    (ValueError / TypeError naming `op` otherwise)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"pk_jax.{op}: {name} must have rank 4 "
                             f"[batch, {seq}, heads, head_dim], got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"pk_jax.{op}: {name} must be floating point "
                            f"(float32, bfloat16, float16, ...), got {a.dtype}")


def _check_shapes(q, k, v) -> None:
    check_qkv_arrays("ring_attention", "seq_local", q, k, v)
    if k.shape != v.shape:
        raise ValueError(f"pk_jax.ring_attention: k and v must have the same shape "
                         f"[batch, seq_local, kv_heads, head_dim], got k {k.shape} "
                         f"and v {v.shape}")
    for dim, what in ((0, "batch"), (1, "seq_local"), (3, "head_dim")):
        if q.shape[dim] != k.shape[dim]:
            raise ValueError(f"pk_jax.ring_attention: q and k/v must have the same {what} "
                             f"(dim {dim}), got q {q.shape} and k/v {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"pk_jax.ring_attention: query heads ({q.shape[2]}) must be a "
                         f"multiple of kv heads ({k.shape[2]}) (MHA, GQA and MQA are "
                         "supported)")


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
        raise TypeError(f"pk_jax.ring_attention: scale must be a Python or NumPy real "
                        f"number or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"pk_jax.ring_attention: scale must be finite, got {scale}")
    return float(scale)


def _check_comm_ctas(num_comm_ctas, mechanism: str) -> int:
    """The ld_st communicator CTA count (None: the default)."""
    if num_comm_ctas is None:
        return DEFAULT_COMM_CTAS
    if mechanism not in ("auto", "ld_st"):
        raise ValueError(f"pk_jax.ring_attention: num_comm_ctas applies to mechanism='ld_st' "
                         f"(or 'auto' where it picks ld_st), not {mechanism!r}")
    if isinstance(num_comm_ctas, (bool, np.bool_)) or not isinstance(num_comm_ctas,
                                                                     (int, np.integer)):
        raise TypeError(f"pk_jax.ring_attention: num_comm_ctas must be an int or None, got "
                        f"{type(num_comm_ctas).__name__}")
    if not 1 <= num_comm_ctas <= MAX_COMM_CTAS:
        raise ValueError(f"pk_jax.ring_attention: num_comm_ctas must be 1..{MAX_COMM_CTAS}, "
                         f"got {num_comm_ctas}")
    return int(num_comm_ctas)


def _validate(q, k, v, axis_name, causal, scale, layout, mechanism,
              num_comm_ctas) -> tuple[RingConfig, int]:
    """(config with the mechanism resolved, ld_st communicator CTAs)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.ring_attention: mechanism must be one of {MECHANISMS}, "
                         f"got {mechanism!r}")
    comm_ctas = _check_comm_ctas(num_comm_ctas, mechanism)
    cfg = _config(q, k, v, axis_name, causal, scale, layout, mechanism)
    return cfg, comm_ctas


def _config(q, k, v, axis_name, causal, scale, layout, mechanism) -> RingConfig:
    if layout not in LAYOUTS:
        raise ValueError(f"pk_jax.ring_attention: layout must be one of {LAYOUTS}, "
                         f"got {layout!r}")
    _check_shapes(q, k, v)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ring_attention: layout='zigzag' needs an even seq_local "
                         f"(two chunks per rank), got {q.shape[1]}; use "
                         "layout='contiguous' or pad the sequence")
    names = groups.axis_names(axis_name)
    cfg = RingConfig(names, lax.axis_size(names), bool(causal),
                     _check_scale(scale, q.shape[3]), layout, "xla")
    if mechanism == "xla":
        return cfg
    why = kernel_problem(q, k, cfg)
    if why is None:
        if mechanism == "auto":
            mechanism = tuning.ring_attention_mechanism(cfg.n, q.shape[1], cfg.causal)
        return dataclasses.replace(cfg, mechanism=mechanism)
    if mechanism in KERNEL_MECHANISMS:
        raise ValueError(f"pk_jax.ring_attention: mechanism={mechanism!r} does not take {why}; "
                         "use mechanism='auto' or 'xla' for this call")
    if runtime.available():  # only where the kernel could have run
        warn_once(f"ring_attention-fallback-{why}", f"pk_jax.ring_attention: the fused "
                  f"kernel does not take {why}; using the pure-JAX ring")
    return cfg


# ---- forward (kernel or reference) and the ring backward ------------------------
def _forward(q, k, v, cfg: RingConfig, comm_ctas: int):
    if cfg.mechanism in KERNEL_MECHANISMS:
        return fused_forward(q, k, v, cfg, comm_ctas)
    return ring_reference(q, k, v, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend(q, k, v, cfg: RingConfig, comm_ctas: int):
    return _forward(q, k, v, cfg, comm_ctas)


def _attend_fwd(q, k, v, cfg: RingConfig, comm_ctas: int):
    out, lse = _forward(q, k, v, cfg, comm_ctas)
    return (out, lse), (q, k, v, out, lse)


def _attend_bwd(cfg: RingConfig, comm_ctas: int, res, cotangents):
    # The ring backward from the saved output and log-sum-exp (same for both
    # forwards): no per-step residuals, blocks recomputed one at a time.
    q, k, v, out, lse = res
    dout, dlse = cotangents
    return ring_reference_bwd(q, k, v, out, lse, dout, dlse, cfg)


_attend.defvjp(_attend_fwd, _attend_bwd)


# ---- public API ----------------------------------------------------------------
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   axis_name: str | Sequence[str], *, causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous",
                   return_lse: bool = False, mechanism: str = "auto",
                   num_comm_ctas: int | None = None, deterministic: bool = False):
    """Attention over a sequence sharded along `axis_name`; equal to
    `jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)` on
    the whole (unsharded) sequence, this device's rows.

    Call inside `jax.shard_map` with the sequence dim sharded over
    `axis_name`. Every device's K/V block reaches every other device (the
    fused kernel's copy-engine or communicator-CTA pushes, or the
    reference's ppermute ring);
    scores and the softmax are fp32 whatever the input dtype. Differentiable
    (first order): the backward is a ring too (module docstring).

    Args:
      q: this device's queries [B, S_local, Hq, D], floating point.
      k: keys [B, S_local, Hkv, D] of the same tokens; Hq must be a multiple
        of Hkv (query head h uses kv head h // (Hq // Hkv): GQA / MQA).
      v: values, same shape as k.
      axis_name: mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask keys at later global positions than the query.
      scale: score scale; None: 1 / sqrt(D).
      layout: which global tokens this device holds. "contiguous": rank r
        holds [r * S_local, (r + 1) * S_local). "zigzag": the sequence is cut
        into 2n chunks of S_local / 2 and rank r holds chunks r and
        2n - 1 - r (balanced causal work; S_local must be even; reorder
        global arrays with `zigzag_shard` before sharding).
      return_lse: also return the log-sum-exp of the scaled scores.
      mechanism: "auto", "copy_engine" or "ld_st" (the fused kernel, its
        K/V pushed by the copy engines or by communicator CTAs; both raise
        ValueError for shapes it does not take) or "xla" (the pure-JAX
        ring); see the module docstring.
      num_comm_ctas: "ld_st" only (or "auto", should it pick ld_st): the
        communicator CTAs (SMs) pushing K/V, 1..32; None: 16.
      deterministic: bitwise-reproducible gradients: the backward's block
        gradients are computed as einsums in the ring's fixed order, never by
        the block-backward kernel (whose dq reduce-adds land in arrival
        order; see `pk_jax.configure(ring_backward_kernel=...)`). The
        forward is deterministic either way.

    Returns:
      out [B, S_local, Hq, D] in q's dtype, and with return_lse also the
      natural log-sum-exp [B, Hq, S_local] in float32 (of the scaled
      scores; a row with no visible key, impossible with these layouts,
      would get output 0 and log-sum-exp -1e30, never NaN).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cfg, comm_ctas = _validate(q, k, v, axis_name, causal, scale, layout, mechanism,
                               num_comm_ctas)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"pk_jax.ring_attention: deterministic must be a bool, got "
                        f"{type(deterministic).__name__}")
    cfg = dataclasses.replace(cfg, deterministic=bool(deterministic))
    q, k, v = (make_varying(x, cfg.names) for x in (q, k, v))
    if cfg.mechanism == "xla" and cfg.n == 1 and not return_lse:
        # One rank holds the whole sequence in natural order (zigzag with one
        # rank is the identity): XLA's own attention (jax.nn's default
        # implementation, not cuDNN) is what "xla" means here.
        return jax.nn.dot_product_attention(q, k, v, scale=cfg.scale, is_causal=cfg.causal)
    out, lse = _attend(q, k, v, cfg, comm_ctas)
    return (out, lse) if return_lse else out


def _check_zigzag(x: jax.Array, axis_size: int, seq_axis: int, op: str) -> int:
    """The normalized seq_axis, after checking the arguments."""
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) \
            or axis_size < 1:
        raise ValueError(f"pk_jax.{op}: axis_size must be a positive int, got {axis_size!r}")
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(f"pk_jax.{op}: seq_axis={seq_axis} out of range for a rank-{x.ndim} "
                         f"array (valid: {-x.ndim}..{x.ndim - 1})")
    dim = seq_axis % x.ndim
    if x.shape[dim] % (2 * axis_size):
        raise ValueError(f"pk_jax.{op}: the sequence length ({x.shape[dim]}, axis {dim}) "
                         f"must divide by 2 * axis_size ({2 * axis_size})")
    return dim


def zigzag_shard(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Reorder a global array so that contiguous sharding of `seq_axis` over
    `axis_size` ranks gives rank r the zigzag chunks r and 2n - 1 - r.

    Args:
      x: the global array (q, k, v, positions, labels, ...), any rank.
      axis_size: n, the size of the mesh axis the sequence is sharded over.
      seq_axis: the sequence axis; its length must divide by 2n.

    Returns:
      x with its 2n sequence chunks in the order 0, 2n-1, 1, 2n-2, ...
    """
    x = jnp.asarray(x)
    dim = _check_zigzag(x, axis_size, seq_axis, "zigzag_shard")
    n, shape = axis_size, x.shape
    # [..., L, ...] -> [..., 2 (halves), n, c, ...]; rank r takes chunk r of the
    # first half and chunk n - 1 - r of the second (= chunk 2n - 1 - r).
    halves = x.reshape(shape[:dim] + (2, n, shape[dim] // (2 * n)) + shape[dim + 1:])
    first, second = jnp.take(halves, 0, axis=dim), jnp.take(halves, 1, axis=dim)
    return jnp.stack([first, jnp.flip(second, dim)], dim + 1).reshape(shape)


def zigzag_unshard(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Inverse of `zigzag_shard`: back to the natural token order.

    Args:
      x: a global array in zigzag order (e.g. the gathered ring_attention
        output of layout="zigzag").
      axis_size: n, the size of the mesh axis.
      seq_axis: the sequence axis; its length must divide by 2n.

    Returns:
      x with its sequence in natural order.
    """
    x = jnp.asarray(x)
    dim = _check_zigzag(x, axis_size, seq_axis, "zigzag_unshard")
    n, shape = axis_size, x.shape
    pairs = x.reshape(shape[:dim] + (n, 2, shape[dim] // (2 * n)) + shape[dim + 1:])
    first, second = jnp.take(pairs, 0, axis=dim + 1), jnp.take(pairs, 1, axis=dim + 1)
    return jnp.stack([first, jnp.flip(second, dim)], dim).reshape(shape)
