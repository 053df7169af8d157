"""The pure-JAX ring attention: the reference every kernel is checked against
and the path taken where no kernel runs (other platforms, shapes the kernel
does not take, mechanism="xla") and the backward ring (whose per-step block
gradients run as a kernel on GPUs for the fused mechanisms unless
`pk_jax.configure(ring_backward_kernel=False)`).

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
    mechanism: str  # "xla" or a fused mechanism ("copy_engine", ...) after validation
    # Backward block gradients as pure-JAX einsums in the ring's fixed order
    # (never the block kernel, whose dq reduce-adds land in arrival order).
    deterministic: bool = False


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


def _scores(q5, k, q_pos, k_pos, cfg: RingConfig):
    """Scaled fp32 scores [B, K, G, S, T] of q5 [B, S, K, G, D] against one
    K block [B, T, K, D], and the causal visibility [S, T] (None if not causal)."""
    s = jnp.einsum("bskgd,btkd->bkgst", q5, k.astype(jnp.float32),
                   preferred_element_type=jnp.float32) * cfg.scale
    return s, (q_pos[:, None] >= k_pos[None, :]) if cfg.causal else None


def _block_update(state, q5, k, v, q_pos, k_pos, cfg: RingConfig):
    """Merge attention of q5 [B, S, K, G, D] to one K/V block [B, T, K, D]
    into the running (max, sum, output) state; all in fp32."""
    m, l, acc = state
    s, visible = _scores(q5, k, q_pos, k_pos, cfg)
    if cfg.causal:
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


def _ring_axes(q5, cfg: RingConfig) -> tuple[str, ...]:
    """Axes the per-device state varies over: the ring's and any other axis q
    is sharded on (a 2-D mesh), or the scan's carry types would differ."""
    return tuple(sorted(set(cfg.names) | varying_axes(q5)))


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(r, (r + 1) % n) for r in range(n)]


def _ring_steps(cfg: RingConfig, moving: tuple, fixed, update):
    """n steps of `update(moving, fixed, step) -> (moving, fixed)`, passing the
    arrays of `moving` from rank r to r + 1 between steps (n - 1 hops); at
    step s a rank holds the blocks that started on rank r - s. Returns the
    last step's (moving, fixed)."""
    perm = _ring_perm(cfg.n)

    def body(carry, step):
        moving, fixed = update(*carry, step)
        return (tuple(lax.ppermute(x, cfg.names, perm) for x in moving), fixed), None

    carry, _ = lax.scan(body, (moving, fixed), jnp.arange(cfg.n - 1, dtype=jnp.int32))
    return update(*carry, jnp.int32(cfg.n - 1))


def ring_reference(q, k, v, cfg: RingConfig) -> tuple[jax.Array, jax.Array]:
    """The ring: n blockwise updates, the K/V block moving r -> r + 1 between them."""
    b, s_local, hq, d = q.shape
    kh = k.shape[2]
    n = cfg.n
    rank = lax.axis_index(cfg.names)
    q5 = q.astype(jnp.float32).reshape(b, s_local, kh, hq // kh, d)
    q_pos = _positions(rank, n, s_local, cfg.layout)

    def update(blocks, state, step):
        kb, vb = blocks
        k_pos = _positions((rank - step) % n, n, s_local, cfg.layout)
        return blocks, _block_update(state, q5, kb, vb, q_pos, k_pos, cfg)

    axes = _ring_axes(q5, cfg)
    state = tuple(make_varying(x, axes) for x in _init_state(q5))
    _, state = _ring_steps(cfg, (k, v), state, update)
    return _finish(state, q.shape, q.dtype)


def _block_grads(q5, do5, delta, lse4, dlse4, kb, vb, q_pos, k_pos, cfg: RingConfig):
    """Gradient contributions of one K/V block [B, T, K, D], recomputing the
    probabilities from the saved log-sum-exp: (dq5, dk, dv), all fp32.

    p = exp(s - lse); dv = p^T do; dp = do v^T; ds = p (dp - delta + dlse);
    dq = scale ds k; dk = scale ds^T q (summed over the group's query heads).
    """
    kf, vf = kb.astype(jnp.float32), vb.astype(jnp.float32)
    s, visible = _scores(q5, kf, q_pos, k_pos, cfg)
    p = jnp.exp(s - lse4[..., None])
    if cfg.causal:
        p = jnp.where(visible, p, 0.0)
    dv = jnp.einsum("bkgst,bskgd->btkd", p, do5, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bskgd,btkd->bkgst", do5, vf, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None] + dlse4[..., None]) * cfg.scale
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, kf, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, q5, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _backward_ring(cfg: RingConfig, kv, grads, axes, out_dtype):
    """The backward's ring schedule: (dq fp32 summed over the n blocks,
    dkv [2, B, T, Hkv, D] of `out_dtype` on the rank that owns the block).

    `kv` stacks this rank's K and V, so every hop is one collective (XLA's
    GPU scheduler keeps one collective-permute in flight: a K hop and a V
    hop would leave one of the two exposed). `grads(kv_block, step)` gives
    one block's (dq, dkv), fp32. Step s works on the block that started on
    rank r - s; its partial dK/dV is the sum of ranks r - s .. r (a fixed
    order). Both hops of a step are issued before its block gradients and
    neither is needed until after them: the K/V block of step s + 1
    (prefetched), and the partial dK/dV that rank r - 1 finished at step
    s - 1 (added to ours after our block gradients). So the only hop left on
    the critical path is the last one, taking dK/dV home; it carries the
    finished sums already cast to `out_dtype` (casting commutes with a hop:
    the same result for half the bytes).
    """
    n = cfg.n
    hop = lambda x: lax.ppermute(x, cfg.names, _ring_perm(n))
    vary = lambda xs: tuple(make_varying(x, axes) for x in xs)
    if n == 1:
        dq, dkv = vary(grads(kv, jnp.int32(0)))
        return dq, dkv.astype(out_dtype)
    kv_next = hop(kv)  # the block of step 1, in flight during step 0
    dq, dkv = vary(grads(kv, jnp.int32(0)))

    def step(block, partial, dq, s, prefetch: bool):
        """Step s >= 1 on `block` (its K, V): (the block of step s + 1 if
        `prefetch`, the partial dK/dV of `block` up to this rank, dq)."""
        incoming = hop(partial)  # rank r - 1's partial of the block we hold now
        block_next = hop(block) if prefetch else None
        g_dq, g_dkv = grads(block, s)
        return block_next, incoming + g_dkv, dq + g_dq

    carry = (kv_next, dkv, dq)
    if n > 2:  # steps 1 .. n - 2 prefetch the next block; the last one does not
        carry, _ = lax.scan(lambda c, s: (step(*c, s, prefetch=True), None), carry,
                            jnp.arange(1, n - 1, dtype=jnp.int32))
    _, dkv, dq = step(*carry, jnp.int32(n - 1), prefetch=False)
    # The block we hold now belongs to rank r + 1: one hop home.
    return dq, hop(dkv.astype(out_dtype))


def ring_reference_bwd(q, k, v, out, lse, dout, dlse, cfg: RingConfig):
    """Gradients (dq, dk, dv) of ring attention from the forward's output and
    log-sum-exp, as a ring (`_backward_ring`): each K/V block travels r -> r + 1
    with its partial dK/dV, every rank adds its queries' share, and after n
    steps one more hop takes dK/dV home. dq stays local. Memory: one block's
    scores at a time (no per-step residuals). The ring sums in a fixed order; each step's block
    gradients are the block kernel for the fused mechanisms (whose dq
    reduce-adds land in arrival order), or einsums (deterministic) for
    mechanism "xla", `cfg.deterministic`, shapes the kernel does not take and
    `pk_jax.configure(ring_backward_kernel=False)`.

    `out` [B, S, Hq, D], `lse` [B, Hq, S] as the forward returned them;
    `dout`, `dlse` their cotangents (dlse may be None).
    """
    b, s_local, hq, d = q.shape
    kh = k.shape[2]
    g = hq // kh
    n = cfg.n
    rank = lax.axis_index(cfg.names)
    f32 = jnp.float32
    q5, do5, o5 = (x.astype(f32).reshape(b, s_local, kh, g, d) for x in (q, dout, out))
    delta = jnp.einsum("bskgd,bskgd->bkgs", do5, o5)  # rowsum(dO * O)
    lse4 = lse.astype(f32).reshape(b, kh, g, s_local)
    dlse4 = jnp.zeros_like(lse4) if dlse is None else dlse.astype(f32).reshape(lse4.shape)
    q_pos = _positions(rank, n, s_local, cfg.layout)
    # The fused mechanisms run each step's block gradients as one kernel
    # (pk_attention_block_bwd; _block_grads wherever it lowers elsewhere)
    # unless pk_jax.configure(ring_backward_kernel=False).
    from pk_jax.config import get_config
    from pk_jax.ops import attention_bwd_primitive as block_bwd  # imports this module
    kernel = (get_config().ring_backward_kernel and cfg.mechanism != "xla" and not cfg.deterministic
              and dout.dtype == q.dtype and v.dtype == k.dtype
              and block_bwd.kernel_problem(q, k, cfg) is None)
    if kernel:
        lse3, delta3 = lse.astype(f32), (delta - dlse4).reshape(b, hq, s_local)

    def grads(kvb, step):
        """(dq, dkv) fp32 of this rank's queries against the block (K and V
        stacked) that started on rank - step."""
        if kernel:
            dq_s, dkv_s = block_bwd.pk_attention_block_bwd_kv(
                q, dout, lse3, delta3, kvb, rank, (rank - step) % n, cfg)
            return dq_s.reshape(q5.shape), dkv_s
        k_pos = _positions((rank - step) % n, n, s_local, cfg.layout)
        dq_s, dk_s, dv_s = _block_grads(q5, do5, delta, lse4, dlse4, kvb[0], kvb[1], q_pos,
                                        k_pos, cfg)
        return dq_s, jnp.stack([dk_s, dv_s])

    # K and V travel stacked (jnp.stack promotes mixed dtypes; the home hop
    # then carries fp32).
    home = k.dtype if k.dtype == v.dtype else f32
    dq, dkv = _backward_ring(cfg, jnp.stack([k, v]), grads, _ring_axes(q5, cfg), home)
    return dq.reshape(q.shape).astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)
