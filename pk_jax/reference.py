"""Pure-lax implementations: the path where no kernel runs (CPU, shapes the
kernels do not take, mechanism="xla") and the oracle of the tests.

Only math lives here: each function has exactly the semantics of the
matching pk_jax op (or of one step of it) and knows nothing of mechanisms,
kernels or configuration.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax._compat import make_varying, varying_axes

AxisName = str | Sequence[str]

# The log-sum-exp of a row that sees no key (finite: no inf - inf downstream).
NEG = -1e30


def _axes(axis_name: AxisName):
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


# ---- collectives and tensor-parallel matmuls -------------------------------------
def all_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0,
               tiled: bool = False) -> jax.Array:
    """`lax.all_gather` (XLA's collective; NCCL on GPUs)."""
    return lax.all_gather(x, _axes(axis_name), axis=axis, tiled=tiled)


def all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """`lax.psum` (XLA's all-reduce; NCCL on GPUs)."""
    return lax.psum(x, _axes(axis_name))


def reduce_scatter(x: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0,
                   tiled: bool = False) -> jax.Array:
    """`lax.psum_scatter` (XLA's reduce-scatter; NCCL on GPUs)."""
    return lax.psum_scatter(x, _axes(axis_name), scatter_dimension=scatter_dimension,
                            tiled=tiled)


def _dot(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """a[..., K] @ b[K, N] with fp32 accumulation, result in out_dtype."""
    dims = (((a.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: AxisName, *,
                      out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(all_gather(x, axis 0, tiled) @ w, the gathered x)."""
    gathered = lax.all_gather(x, _axes(axis_name), axis=0, tiled=True)
    return _dot(gathered, w, out_dtype or x.dtype), gathered


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: AxisName, *,
                          out_dtype=None) -> jax.Array:
    """psum_scatter(x @ w, scatter_dimension=0, tiled=True)."""
    y = _dot(x, w, out_dtype or x.dtype)
    return lax.psum_scatter(y, _axes(axis_name), scatter_dimension=0, tiled=True)


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name: AxisName, *,
                      out_dtype=None) -> jax.Array:
    """psum(x @ w): the partial products in out_dtype, summed by XLA's psum."""
    return lax.psum(_dot(x, w, out_dtype or x.dtype), _axes(axis_name))


# ---- ring attention ------------------------------------------------------------------
def positions(rank: jax.Array, n: int, s_local: int, layout: str) -> jax.Array:
    """Global token positions [s_local] (int32) of the block that `rank` owns.

    contiguous: rank r holds [r * s_local, (r + 1) * s_local); zigzag: the
    sequence is cut into 2n chunks of s_local / 2 and rank r holds chunks r
    and 2n - 1 - r.
    """
    i = jnp.arange(s_local, dtype=jnp.int32)
    if layout == "contiguous":
        return rank * s_local + i
    half = s_local // 2
    chunk = jnp.where(i < half, rank, 2 * n - 1 - rank)
    return chunk * half + i % half


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, S, Hq, D] -> fp32 [B, S, Hkv, G, D] (query head h is in group h // G)."""
    b, s, hq, d = x.shape
    return x.astype(jnp.float32).reshape(b, s, kv_heads, hq // kv_heads, d)


def _scores(q5, k, q_pos, k_pos, causal: bool, scale: float):
    """Scaled fp32 scores [B, K, G, S, T] of q5 [B, S, K, G, D] against one
    K block [B, T, K, D], and the causal visibility [S, T] (None if not causal)."""
    # The scale goes on q, not on the dot's result: a product x * scale
    # feeding `x * scale - max` may be contracted into one FMA that skips the
    # product's rounding, and at large scales that changes an exponent by
    # thousands; a dot's result is rounded once, wherever it is read.
    s = jnp.einsum("bskgd,btkd->bkgst", q5 * jnp.float32(scale), k.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
    return s, (q_pos[:, None] >= k_pos[None, :]) if causal else None


def _block_update(state, q5, k, v, q_pos, k_pos, causal: bool, scale: float):
    """Merge attention of q5 [B, S, K, G, D] to one K/V block [B, T, K, D]
    into the running (max, sum, output) state; all in fp32.

    The running max bounds every exponent, whatever the scale or the
    logits: the max and the exponentials read the same rounded scores
    (`_scores`), and every exponent is clamped at 0 besides. Masked scores
    are -inf (no finite mask value stays below every real score at huge
    scales); a row that sees no key yet keeps max -inf and adds nothing,
    with no -inf - -inf anywhere."""
    m, l, acc = state
    s, visible = _scores(q5, k, q_pos, k_pos, causal, scale)
    if causal:
        s = jnp.where(visible, s, -jnp.inf)
    # The max only stabilizes the exponentials: the result does not depend on it.
    m_new = lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: any finite value
    p = jnp.exp(jnp.minimum(s - m_ref[..., None], 0.0))
    alpha = jnp.exp(jnp.minimum(m - m_ref, 0.0))
    l = alpha * l + p.sum(axis=-1)
    pv = jnp.einsum("bkgst,btkd->bkgsd", p, v.astype(jnp.float32),
                    preferred_element_type=jnp.float32)
    return m_new, l, alpha[..., None] * acc + pv


def ring_axes(names: tuple[str, ...], x: jax.Array) -> tuple[str, ...]:
    """Axes a ring's per-device state varies over: the ring's and any other
    axis `x` is sharded on (a 2-D mesh), or a scan's carry types would differ."""
    return tuple(sorted(set(names) | varying_axes(x)))


def ring_perm(n: int) -> list[tuple[int, int]]:
    """The ring's hop: rank r sends to r + 1 mod n."""
    return [(r, (r + 1) % n) for r in range(n)]


def _init_state(q5: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(running max, running sum, running output) for q5 [B, S, K, G, D]."""
    b, s, kh, g, d = q5.shape
    m = jnp.full((b, kh, g, s), -jnp.inf, jnp.float32)
    return m, jnp.zeros_like(m), jnp.zeros((b, kh, g, s, d), jnp.float32)


def _row_stats(state, out_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The rows' final running max and sum [B, Hq, S] (lse = max + log(sum)):
    what the backward normalizes its recomputed probabilities by
    (`attention_block_grads`' row_sum)."""
    m, l, _ = state
    b, s, hq, _ = out_shape
    return m.reshape(b, hq, s), l.reshape(b, hq, s)


def _finish(state, out_shape: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array]:
    """Normalized output [B, S, Hq, D] in `dtype` and log-sum-exp [B, Hq, S];
    a row with no visible key gets output 0 and lse NEG."""
    m, l, acc = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    b, s, hq, d = out_shape
    out = jnp.transpose(acc / l_safe[..., None], (0, 3, 1, 2, 4)).reshape(out_shape)
    lse = jnp.where(seen, m + jnp.log(l_safe), NEG).reshape(b, hq, s)
    return out.astype(dtype), lse


def ring_attention(q, k, v, names: tuple[str, ...], *, n: int, causal: bool, scale: float,
                   layout: str, row_stats: bool = False):
    """Attention of this rank's queries to the whole ring's keys: (out [B, S,
    Hq, D] in q's dtype, log-sum-exp [B, Hq, S] fp32), and with `row_stats`
    also the rows' final running max and sum [B, Hq, S] (`_row_stats`).

    n steps of a blockwise online softmax (running max and sum, fp32), the
    K/V block moving r -> r + 1 (`lax.ppermute`) between them, so memory
    stays O(S_local).
    """
    s_local = q.shape[1]
    rank = lax.axis_index(names)
    q5 = _grouped(q, k.shape[2])
    q_pos = positions(rank, n, s_local, layout)
    axes = ring_axes(names, q5)

    def update(kb, vb, state, i):
        k_pos = positions((rank - i) % n, n, s_local, layout)
        return _block_update(state, q5, kb, vb, q_pos, k_pos, causal, scale)

    def step(carry, i):
        kb, vb, state = carry
        state = update(kb, vb, state, i)
        hop = lambda x: lax.ppermute(x, names, ring_perm(n))
        return (hop(kb), hop(vb), state), None

    state = tuple(make_varying(x, axes) for x in _init_state(q5))
    (kb, vb, state), _ = lax.scan(step, (k, v, state), jnp.arange(n - 1, dtype=jnp.int32))
    state = update(kb, vb, state, jnp.int32(n - 1))
    out = _finish(state, q.shape, q.dtype)
    return (*out, *_row_stats(state, q.shape)) if row_stats else out


def attention_block(q, k, v, *, causal: bool, scale: float, q_pos=None, k_pos=None):
    """Attention of q [B, S, Hq, D] to one K/V block [B, T, Hkv, D]: (out
    [B, S, Hq, D] in q's dtype, log-sum-exp [B, Hq, S] fp32), causal by
    global positions (default 0..S-1 and 0..T-1: top-left aligned); one step
    of `ring_attention`'s online softmax."""
    q5 = _grouped(q, k.shape[2])
    q_pos = jnp.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = jnp.arange(k.shape[1]) if k_pos is None else k_pos
    state = _block_update(_init_state(q5), q5, k, v, q_pos, k_pos, causal, scale)
    return _finish(state, q.shape, q.dtype)


def _block_probs(q5, do5, lse, row_sum, k, v, q_pos, k_pos, causal: bool, scale: float):
    """The probabilities p and dp = dout v^T [B, K, G, S, T] of grouped
    queries and output gradients q5, do5 [B, S, K, G, D] against one K/V
    block (fp32), p recomputed as the forward formed it: exp(s - lse), or
    with `row_sum` exp(s - lse) / row_sum, lse then being the rows' final
    running max (`_row_stats`): the max and the sum apart, as the forward
    normalized its output, where lse = max + log(sum) rounds log(sum) away
    at large scores."""
    b, s, kh, g, _ = q5.shape
    rows = lambda x: x.astype(jnp.float32).reshape(b, kh, g, s)[..., None]
    sc, visible = _scores(q5, k, q_pos, k_pos, causal, scale)
    m = rows(lse)
    if row_sum is not None:  # a row that saw no key: max -inf, sum 0, p 0
        m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(jnp.minimum(sc - m, 0.0))  # p <= 1: the max (or lse) bounds every score
    if row_sum is not None:
        total = rows(row_sum)
        p = p / jnp.where(total > 0, total, 1.0)
    if causal:
        p = jnp.where(visible, p, 0.0)
    dp = jnp.einsum("bskgd,btkd->bkgst", do5, v.astype(jnp.float32),
                    preferred_element_type=jnp.float32)
    return p, dp


def attention_block_delta(q, dout, lse, k, v, q_pos, k_pos, *, causal: bool, scale: float,
                          row_sum=None):
    """rowsum(p * dp) [B, Hq, S] fp32 of the queries q [B, S, Hq, D] and
    output gradients dout against one K/V block, p and dp as
    `attention_block_grads` recomputes them. Summed over every block, the
    delta (less dlse) that gives those block gradients the softmax's own
    cancellation: where one key takes a row's whole probability, ds = p (dp
    - delta) is exactly 0, as the true gradient nearly is at large scales,
    where rowsum(dout * out) differs from that key's dp by a rounding, times
    the scale."""
    b, s, hq, _ = q.shape
    kh = k.shape[2]
    p, dp = _block_probs(_grouped(q, kh), _grouped(dout, kh), lse, row_sum, k, v, q_pos, k_pos,
                         causal, scale)
    return jnp.sum(p * dp, axis=-1).reshape(b, hq, s)


def attention_block_grads(q, dout, lse, delta, k, v, q_pos, k_pos, *, causal: bool,
                          scale: float, row_sum=None):
    """Gradient contributions of one K/V block [B, T, Hkv, D] to the queries
    q [B, S, Hq, D], the probabilities recomputed from the forward's
    log-sum-exp: (dq [B, S, Hq, D], dk, dv [B, T, Hkv, D]), all fp32.

    lse, delta [B, Hq, S] fp32, delta = rowsum(dout * out) - dlse, or
    rowsum(p * dp) over the ring's blocks - dlse (`attention_block_delta`).
    p = exp(s - lse) (with `row_sum`, lse the rows' running max: exp(s -
    lse) / row_sum, `_block_probs`); dv = p^T dout; dp = dout v^T; ds = p
    (dp - delta) scale; dq = ds k; dk = ds^T q (summed over each GQA group's
    query heads).
    """
    b, s, hq, d = q.shape
    kh = k.shape[2]
    q5, do5 = _grouped(q, kh), _grouped(dout, kh)
    delta4 = delta.astype(jnp.float32).reshape(b, kh, hq // kh, s)
    kf = k.astype(jnp.float32)
    p, dp = _block_probs(q5, do5, lse, row_sum, kf, v, q_pos, k_pos, causal, scale)
    dv = jnp.einsum("bkgst,bskgd->btkd", p, do5, preferred_element_type=jnp.float32)
    ds = p * (dp - delta4[..., None]) * scale
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, kf, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, q5, preferred_element_type=jnp.float32)
    return dq.reshape(q.shape), dk, dv


def attention(q, k, v, *, causal: bool, scale: float, q_pos=None, k_pos=None) -> jax.Array:
    """Dense attention in fp32 (the tests' oracle): q [B, S, Hq, D], k, v
    [B, T, Hkv, D] (GQA), causal by global positions (default 0..S-1 and
    0..T-1). Returns [B, S, Hq, D] fp32."""
    b, s, hq, d = q.shape
    q_pos = jnp.arange(s) if q_pos is None else q_pos
    k_pos = jnp.arange(k.shape[1]) if k_pos is None else k_pos
    sc, visible = _scores(_grouped(q, k.shape[2]), k, q_pos, k_pos, causal, scale)
    if causal:  # -inf: below every real score at any scale; a row seeing nothing gets 0
        sc = jnp.where(visible, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    e = jnp.exp(sc - jnp.where(m == -jnp.inf, 0.0, m))
    total = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    o = jnp.einsum("bkgst,btkd->bskgd", p, v.astype(jnp.float32))
    return o.reshape(b, s, hq, v.shape[3])

