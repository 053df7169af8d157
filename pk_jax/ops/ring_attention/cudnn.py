"""Ring attention whose steps run cuDNN's fused attention (mechanism "cudnn").

The ring for shapes pk's fused kernel does not take (head dim 256, head dims
other than 64 and 128, sequence lengths off its 128-row tiles): every step
is one cuDNN flash-attention call on the block in hand, the K/V blocks move
r -> r + 1 by XLA collective-permutes issued a step ahead (K and V stacked:
one collective per hop), so each hop flies while the previous block
computes. Where cuDNN's blocks cannot run (no CUDA GPU, no cuDNN 9, a jax
whose private cuDNN API differs: `_compat.cudnn_blocks_available`) the same
ring runs fp32 einsum blocks (pk_jax/reference.py), which is how its
structure is tested on CPU.

Forward: each block gives (output, log-sum-exp); the running fp32 output
merges them by their log-sum-exp. Causal steps compute only what the mask
leaves, with cuDNN's plain masks (the blocks are never partly masked except
our own):
  * own block (step 0): top-left causal. Exact for both layouts: under
    zigzag our rows are chunks (r, 2n-1-r) in that order, so the first
    chunk sees its own keys causally, the second all of the first and its
    own causally;
  * contiguous, an earlier rank's block: all of it, unmasked; a later
    rank's block: nothing (skipped);
  * zigzag, an earlier rank's block (chunks src < r, 2n-1-src > 2n-1-r): all
    our rows see its first chunk and none its second; a later rank's block:
    only our second chunk sees it, both of its chunks.
Backward (`block_grads`, the steps of bwd_primitive.py's ring):
the same cases through cuDNN's backward fed the ring's output and
log-sum-exp, which makes each call's gradients that block's share. cuDNN
derives rowsum(dO * O) from the output, so these block gradients serve
calls whose log-sum-exp is not differentiated (ring_attention's
return_lse=False); dq's reduction order inside cuDNN is not fixed
(deterministic=True takes einsum block gradients).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax import _compat, reference
from pk_jax._compat import make_varying
from pk_jax.ops.ring_attention.primitive import RingConfig

F32 = jnp.float32


# ---- one block: cuDNN on CUDA, fp32 einsum elsewhere -------------------------------
def _on_cuda(cudnn: Callable, einsum: Callable, *args):
    """cudnn(*args) lowered for CUDA and einsum(*args) for other platforms,
    or einsum alone where cuDNN's blocks cannot even be traced."""
    if not _compat.cudnn_blocks_available():
        return einsum(*args)
    return lax.platform_dependent(*args, cuda=cudnn, default=einsum)


def _block_fwd(axes, q, k, v, causal: bool, scale: float):
    """(out in q's dtype, lse [B, Hq, T] fp32) of q against one block."""
    vary = lambda res: tuple(make_varying(x, axes) for x in res)
    cudnn = lambda q, k, v: vary(_compat.cudnn_block(q, k, v, scale=scale, causal=causal))
    einsum = lambda q, k, v: vary(reference.attention_block(q, k, v, causal=causal,
                                                            scale=scale))
    return _on_cuda(cudnn, einsum, q, k, v)


def _block_bwd(axes, q, k, v, out, lse, dout, delta, causal: bool, scale: float):
    """(dq, dk, dv), fp32: one block's share of the gradients, given the
    ring's output / log-sum-exp (cuDNN) or delta = rowsum(dO * O) (einsum)."""
    vary = lambda res: tuple(make_varying(x.astype(F32), axes) for x in res)

    def cudnn(q, k, v, out, lse, dout, delta):
        del delta  # cuDNN computes rowsum(dO * O) itself
        return vary(_compat.cudnn_block_bwd(q, k, v, out, lse, dout, scale=scale,
                                            causal=causal))

    def einsum(q, k, v, out, lse, dout, delta):
        pos = lambda x: jnp.arange(x.shape[1], dtype=jnp.int32)
        dq, dk, dv = reference.attention_block_grads(q, dout, lse, delta, k, v, pos(q), pos(k),
                                                     causal=causal, scale=scale)
        return vary((dq, dk, dv))

    return _on_cuda(cudnn, einsum, q, k, v, out, lse, dout, delta)


# ---- forward ----------------------------------------------------------------------
def _bthd(lse):
    """[B, H, T] -> [B, T, H, 1], to weight outputs [B, T, H, D]."""
    return jnp.transpose(lse, (0, 2, 1))[..., None]


def _merge(state, out, lse):
    """The running (fp32 output, lse) with one more block's (output, lse)."""
    acc, m = state
    new = jnp.logaddexp(m, lse)
    return acc * jnp.exp(_bthd(m - new)) + out.astype(F32) * jnp.exp(_bthd(lse - new)), new


def forward(q, k, v, cfg: RingConfig):
    """(out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] fp32) of this rank's
    queries against the whole ring (module docstring)."""
    n, rank, c = cfg.n, lax.axis_index(cfg.names), q.shape[1] // 2
    axes = reference.ring_axes(cfg.names, q)
    block = lambda q, k, v, causal=False: _block_fwd(axes, q, k, v, causal, cfg.scale)
    hop = lambda x: lax.ppermute(x, cfg.names, reference.ring_perm(n))

    def second_half(state, out, lse):
        acc, m = state
        acc2, m2 = _merge((acc[:, c:], m[..., c:]), out, lse)
        return (jnp.concatenate([acc[:, :c], acc2], axis=1),
                jnp.concatenate([m[..., :c], m2], axis=-1))

    def visit(state, kv, src):
        """`state` with the block that started on rank `src` != rank."""
        kb, vb = kv[0], kv[1]
        if not cfg.causal:
            return _merge(state, *block(q, kb, vb))
        if cfg.layout == "contiguous":
            return lax.cond(src < rank, lambda st: _merge(st, *block(q, kb, vb)),
                            lambda st: st, state)
        return lax.cond(src < rank,
                        lambda st: _merge(st, *block(q, kb[:, :c], vb[:, :c])),
                        lambda st: second_half(st, *block(q[:, c:], kb, vb)),
                        state)

    def step(kv, state, s, prefetch: bool):
        nxt = hop(kv) if prefetch else None  # the next step's block, in flight now
        return nxt, visit(state, kv, (rank - s) % n)

    kv = jnp.stack([k, v])
    kv_next = hop(kv) if n > 1 else None
    out, lse = block(q, k, v, cfg.causal)
    state = (out.astype(F32), lse)
    if n > 2:  # steps 1 .. n - 2 prefetch the next block; the last one does not
        (kv_next, state), _ = lax.scan(lambda cr, s: (step(*cr, s, prefetch=True), None),
                                       (kv_next, state), jnp.arange(1, n - 1, dtype=jnp.int32))
    if n > 1:
        _, state = step(kv_next, state, jnp.int32(n - 1), prefetch=False)
    acc, lse = state
    return acc.astype(q.dtype), lse


# ---- backward: the steps of bwd_primitive.py's ring --------------------------------
def block_grads(cfg: RingConfig, q, out, lse, dout, delta) -> Callable:
    """grads(kv [2, B, T, Hkv, D], step) -> (dq [B, S, Hq, D], dkv [2, B, T,
    Hkv, D]), fp32: the gradients of this rank's queries against the block
    that started on rank - step (module docstring's cases)."""
    n, rank, c = cfg.n, lax.axis_index(cfg.names), q.shape[1] // 2
    axes = reference.ring_axes(cfg.names, q)
    zeros = lambda x, rows: make_varying(jnp.zeros(x.shape[:1] + (rows,) + x.shape[2:], F32),
                                         axes)

    def bwd(rows: slice, kb, vb, causal=False):
        """Block gradients of our query rows `rows` against (kb, vb)."""
        return _block_bwd(axes, q[:, rows], kb, vb, out[:, rows], lse[..., rows],
                          dout[:, rows], delta[..., rows], causal, cfg.scale)

    def own(kb, vb):
        return bwd(slice(None), kb, vb, cfg.causal)

    def earlier(kb, vb):
        if cfg.layout == "contiguous":
            return bwd(slice(None), kb, vb)
        dq, dk, dv = bwd(slice(None), kb[:, :c], vb[:, :c])  # its first chunk only
        pad = lambda g: jnp.concatenate([g, zeros(g, kb.shape[1] - c)], axis=1)
        return dq, pad(dk), pad(dv)

    def later(kb, vb):
        if cfg.layout == "contiguous":  # masked entirely
            return zeros(q, q.shape[1]), zeros(kb, kb.shape[1]), zeros(vb, vb.shape[1])
        dq, dk, dv = bwd(slice(c, None), kb, vb)  # our second chunk only
        return jnp.concatenate([zeros(dq, c), dq], axis=1), dk, dv

    def grads(kv, step):
        kb, vb = kv[0], kv[1]
        if not cfg.causal:
            dq, dk, dv = bwd(slice(None), kb, vb)
        elif not isinstance(step, jax.core.Tracer) and int(step) == 0:
            dq, dk, dv = own(kb, vb)  # step 0: our own block, known at trace time
        else:
            src = (rank - step) % n
            which = jnp.where(src == rank, 0, jnp.where(src < rank, 1, 2))
            dq, dk, dv = lax.switch(which, (own, earlier, later), kb, vb)
        return dq, jnp.stack([dk, dv])

    return grads
