"""The pure-JAX ring attention: the reference every kernel is checked against
and the path taken where no kernel runs (other platforms, shapes the kernel
does not take, mechanism="xla", and the backward pass for now).

The K/V blocks travel around the ring with `lax.ppermute` (rank r sends to
r + 1 mod n); at each of the n steps a device attends its queries to the
visiting block and merges the partial result into a running output with an
online softmax (running max and sum of exponentials, fp32), so memory stays
O(S_local). Causal masks use global token positions from the rank, the step
and the layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax._compat import make_varying, varying_axes

# Mask value of the scores: finite, so fully masked rows give no inf - inf.
_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static part of one call, validated once."""

    names: tuple[str, ...]
    n: int
    causal: bool
    scale: float
    layout: str
    mechanism: str  # "xla" or "copy_engine" after validation


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


def _block_update(state, q5, k, v, q_pos, k_pos, cfg: RingConfig):
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


def ring_reference(q, k, v, cfg: RingConfig) -> tuple[jax.Array, jax.Array]:
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


