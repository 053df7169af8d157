"""pk_jax.ring_attention: sequence-parallel attention over a mesh axis.

Every device of `axis_name` holds a slice of the sequence (q, k and v of the
same tokens). The K/V blocks travel around the ring with `lax.ppermute`
(rank r sends to r + 1 mod n); at each of the n steps a device attends its
queries to the visiting block and merges the partial result into a running
output with an online softmax (running max and sum of exponentials, fp32), so
memory stays O(S_local) and the result equals attention over the whole
sequence.

Causal masks use global token positions, computed from the rank, the step
and the layout, so both layouts are exact:
  * "contiguous": rank r holds tokens [r * S_local, (r + 1) * S_local).
  * "zigzag": the sequence is cut into 2n chunks of S_local / 2 tokens and
    rank r holds chunks r and 2n - 1 - r, so every rank has the same causal
    work. `zigzag_shard` / `zigzag_unshard` reorder global arrays to and from
    this layout.

Path choice: only the pure-JAX reference exists for now (mechanism "auto" and
"xla" both take it); it is differentiable by JAX autodiff.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import groups, runtime
from pk_jax._compat import make_varying, varying_axes
from pk_jax._warnings import warn_once

MECHANISMS = ("auto", "xla")
LAYOUTS = ("contiguous", "zigzag")
# Mask value of the scores: finite, so fully masked rows give no inf - inf.
_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static part of one call, validated once."""

    names: tuple[str, ...]
    n: int
    causal: bool
    scale: float
    layout: str
    mechanism: str  # "xla" after validation (the only path so far)


def _check_shapes(q, k, v) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"pk_jax.ring_attention: {name} must have rank 4 "
                             f"[batch, seq_local, heads, head_dim], got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"pk_jax.ring_attention: {name} must be floating point "
                            f"(float32, bfloat16, float16, ...), got {a.dtype}")
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


def _validate(q, k, v, axis_name, causal, scale, layout, mechanism) -> _Config:
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.ring_attention: mechanism must be one of {MECHANISMS}, "
                         f"got {mechanism!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"pk_jax.ring_attention: layout must be one of {LAYOUTS}, "
                         f"got {layout!r}")
    _check_shapes(q, k, v)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ring_attention: layout='zigzag' needs an even seq_local "
                         f"(two chunks per rank), got {q.shape[1]}; use "
                         "layout='contiguous' or pad the sequence")
    names = groups.axis_names(axis_name)
    cfg = _Config(names, lax.axis_size(names), bool(causal), _check_scale(scale, q.shape[3]),
                  layout, "xla")
    if mechanism == "auto" and runtime.available():
        warn_once("ring_attention-no-kernel", "pk_jax.ring_attention: no fused kernel yet; "
                  "using the pure-JAX ring reference path")
    return cfg


# ---- positions -----------------------------------------------------------------
def _positions(rank: jax.Array, n: int, s_local: int, layout: str) -> jax.Array:
    """Global token positions [s_local] (int32) of the block that `rank` owns."""
    i = jnp.arange(s_local, dtype=jnp.int32)
    if layout == "contiguous":
        return rank * s_local + i
    half = s_local // 2
    chunk = jnp.where(i < half, rank, 2 * n - 1 - rank)
    return chunk * half + i % half


# ---- blockwise online softmax --------------------------------------------------
def _init_state(q5: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(running max, running sum, running output) for q5 [B, S, K, G, D]."""
    b, s, kh, g, d = q5.shape
    m = jnp.full((b, kh, g, s), _NEG, jnp.float32)
    return m, jnp.zeros_like(m), jnp.zeros((b, kh, g, s, d), jnp.float32)


def _block_update(state, q5, k, v, q_pos, k_pos, cfg: _Config):
    """Merge attention of q5 [B, S, K, G, D] to one K/V block [B, T, K, D]
    into the running (max, sum, output) state; all in fp32."""
    m, l, acc = state
    s = jnp.einsum("bskgd,btkd->bkgst", q5, k.astype(jnp.float32),
                   preferred_element_type=jnp.float32) * cfg.scale
    if cfg.causal:
        visible = q_pos[:, None] >= k_pos[None, :]
        s = jnp.where(visible, s, _NEG)
    # The max only stabilizes the exponentials: the result does not depend on it.
    m_new = lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
    p = jnp.exp(s - m_new[..., None])
    if cfg.causal:  # rows with nothing visible yet have m_new == _NEG and exp(0) == 1
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(axis=-1)
    pv = jnp.einsum("bkgst,btkd->bkgsd", p, v.astype(jnp.float32),
                    preferred_element_type=jnp.float32)
    return m_new, l, alpha[..., None] * acc + pv


def _finish(state, out_shape: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array]:
    """Normalized output [B, S, Hq, D] in `dtype` and log-sum-exp [B, Hq, S]."""
    m, l, acc = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = acc / l_safe[..., None]
    b, s, hq, d = out_shape
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(out_shape).astype(dtype)
    lse = jnp.where(seen, m + jnp.log(l_safe), _NEG).reshape(b, hq, s)
    return out, lse


def _ring_reference(q, k, v, cfg: _Config) -> tuple[jax.Array, jax.Array]:
    """The ring: n blockwise updates, the K/V block moving r -> r + 1 between them."""
    b, s_local, hq, d = q.shape
    kh = k.shape[2]
    n = cfg.n
    rank = lax.axis_index(cfg.names)
    q5 = q.astype(jnp.float32).reshape(b, s_local, kh, hq // kh, d)
    q_pos = _positions(rank, n, s_local, cfg.layout)
    perm = [(r, (r + 1) % n) for r in range(n)]

    def update(state, kb, vb, step):
        k_pos = _positions((rank - step) % n, n, s_local, cfg.layout)
        return _block_update(state, q5, kb, vb, q_pos, k_pos, cfg)

    def body(carry, step):
        kb, vb, state = carry
        state = update(state, kb, vb, step)
        kb, vb = (lax.ppermute(x, cfg.names, perm) for x in (kb, vb))
        return (kb, vb, state), None

    # The running state varies like q: over the ring and over any other axis
    # q is sharded on (a 2-D mesh), or the scan's carry types would differ.
    axes = tuple(sorted(set(cfg.names) | varying_axes(q5)))
    state = tuple(make_varying(x, axes) for x in _init_state(q5))
    (kb, vb, state), _ = lax.scan(body, (k, v, state), jnp.arange(n - 1, dtype=jnp.int32))
    state = update(state, kb, vb, jnp.int32(n - 1))
    return _finish(state, q.shape, q.dtype)


# ---- public API ----------------------------------------------------------------
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   axis_name: str | Sequence[str], *, causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous",
                   return_lse: bool = False, mechanism: str = "auto"):
    """Attention over a sequence sharded along `axis_name`; equal to
    `jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)` on
    the whole (unsharded) sequence, this device's rows.

    Call inside `jax.shard_map` with the sequence dim sharded over
    `axis_name`. The K/V blocks circulate around the ring with
    `lax.ppermute`; scores and the softmax are fp32 whatever the input dtype.
    Differentiable by JAX autodiff.

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
      mechanism: "auto" or "xla"; both run the pure-JAX ring for now.

    Returns:
      out [B, S_local, Hq, D] in q's dtype, and with return_lse also the
      natural log-sum-exp [B, Hq, S_local] in float32 (of the scaled
      scores; a row with no visible key, impossible with these layouts,
      would get output 0 and log-sum-exp -1e30, never NaN).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cfg = _validate(q, k, v, axis_name, causal, scale, layout, mechanism)
    q, k, v = (make_varying(x, cfg.names) for x in (q, k, v))
    out, lse = _ring_reference(q, k, v, cfg)
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
