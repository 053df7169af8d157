"""The ring attention backward: the ring schedule over XLA's collectives, and
the primitive of the fused backward whose transport is pk's.

Both compute, for this rank's queries and every K/V block of the ring,

    q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] float32 (delta' =
    rowsum(dout * out) - dlse); k, v [B, T, Hkv, D] (this rank's block)
    -> dq [B, S, Hq, D] float32 (summed over the n blocks) and dk, dv
    [B, T, Hkv, D] of k's dtype (this rank's block, summed over the n
    ranks' queries),

with each K/V block travelling r -> r + 1 together with its partial dK/dV
(every rank adds its queries' share in ring order) and one last hop home.

`ppermute_backward`: the steps are `cfg.block_grads` (the block kernel
primitive, einsums, or the step function the caller passes: cuDNN's
backward, cudnn.py), the hops `lax.ppermute`s between them
(K and V stacked, one collective per hop). A ring of one is one block call writing
dk and dv in k's dtype: nothing to stack, sum or cast.

`pk_ring_attention_bwd` (`fused_backward`, for block_grads "kernel" on
rings of 2 or more): one FFI call per backward (xla_ffi/ring_attention_bwd.cc,
csrc/kernels/ring_attention_bwd) runs the block kernel at every step while
the copy engines move K/V and the partial dK/dV hop by hop into the next
rank's staging region (two K/V slots and one partial slot, reused under
per-slot credits, so the region does not grow with n) with posted flags: no
XLA collective in between. Its lowering is
`ppermute_backward` off CUDA, and on CUDA wherever the fused call cannot run
(no peer access on the axis, the extension missing, or a staging region
that does not fit the workspace: then with a one-time warning), so every
fallback is the XLA-collective ring.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import reference
from pk_jax._compat import make_varying, result_aval, vary_alike
from pk_jax._warnings import warn_once
from pk_jax.errors import PkJaxError
from pk_jax.ops.ring_attention import attention_bwd_primitive as block_bwd
from pk_jax.ops._lowering import channel_attr, kernel_group
from pk_jax.ops.ring_attention.primitive import RingConfig, block_layout

STAMP_BYTES = 512  # kStampBytes (csrc/kernels/ring_attention_bwd/ring_attention_bwd.h)


def _block_elems(k_shape) -> int:
    return 2 * int(np.prod(k_shape))  # K and V: 2 * B * T * Hkv * D


def region_bytes(n: int, k_shape) -> int:
    """The fused call's staging region (Layout::region_bytes), the same for
    every ring size n: two K/V slots (input type; K/V travel hop by hop, one
    slot read by the step's kernel while the next block fills the other) and
    one fp32 partial dK/dV slot (it receives our own dK/dV at the end), i.e.
    8 bytes per element of one K block."""
    del n  # bounded: slots are reused under per-slot credits
    e = _block_elems(k_shape)
    return 2 * (2 * e) + 4 * e


def scratch_bytes(k_shape) -> int:
    """The fused call's local buffers (Layout::scratch_bytes): the stamp
    table, the block kernel's fp32 dK/dV, the partial we push on (fp32), the
    cast home value."""
    e = _block_elems(k_shape)
    return STAMP_BYTES + 4 * e + 4 * e + 2 * e


# ---- the XLA-collective ring ---------------------------------------------------
def _ring(cfg: RingConfig, kv, grads: Callable, axes, out_dtype):
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
    the same result for half the bytes). Steps 0 and n - 1 are unrolled
    around a scan of the others, so no hop that reads a step's block
    gradients sits at a loop-iteration boundary.
    """
    n = cfg.n
    hop = lambda x: lax.ppermute(x, cfg.names, reference.ring_perm(n))
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


def ppermute_backward(cfg: RingConfig, q, dout, lse, delta, k, v, *,
                      grads: Callable | None = None, row_sum=None):
    """(dq fp32, dk, dv of k's dtype): the ring of `_ring` whose steps run
    `grads` (`_ring`'s step function; None: `cfg.block_grads` "kernel" or
    "einsum", the einsums' probabilities normalized by `row_sum` where
    given: `reference.attention_block_grads`) and whose hops are XLA
    collective-permutes."""
    rank = lax.axis_index(cfg.names)
    if cfg.n == 1 and cfg.block_grads == "kernel" and grads is None:
        # The whole ring is our own block: the kernel's gradients are final.
        return block_bwd.block_bwd(q, dout, lse, delta, k, v, rank, rank, cfg, k.dtype)
    q_pos = reference.positions(rank, cfg.n, q.shape[1], cfg.layout)
    if grads is None:
        grads = functools.partial(_kernel_or_einsum_grads, cfg, q, dout, lse, delta, row_sum,
                                  rank, q_pos)
    dq, dkv = _ring(cfg, jnp.stack([k, v]), grads, reference.ring_axes(cfg.names, q), k.dtype)
    return dq, dkv[0], dkv[1]


def ppermute_delta(cfg: RingConfig, q, dout, lse, k, v, row_sum=None):
    """rowsum(p * dp) [B, Hq, S] fp32 of this rank's queries over every
    K/V block of the ring (`reference.attention_block_delta`, p and dp as
    the einsum block gradients recompute them), in ring order: the einsum
    backward's first pass, its delta consistent with its block gradients.
    The K/V blocks travel as in `_ring` (stacked, the next hop in flight
    while a block computes)."""
    n, rank = cfg.n, lax.axis_index(cfg.names)
    q_pos = reference.positions(rank, n, q.shape[1], cfg.layout)
    hop = lambda x: lax.ppermute(x, cfg.names, reference.ring_perm(n))

    def part(kv, step):
        k_pos = reference.positions((rank - step) % n, n, kv.shape[2], cfg.layout)
        return reference.attention_block_delta(q, dout, lse, kv[0], kv[1], q_pos, k_pos,
                                               causal=cfg.causal, scale=cfg.scale,
                                               row_sum=row_sum)

    def step(carry, s):
        kv, delta = carry
        return (hop(kv), delta + part(kv, s)), None

    kv = jnp.stack([k, v])
    delta = make_varying(jnp.zeros(lse.shape, jnp.float32), reference.ring_axes(cfg.names, q))
    (kv, delta), _ = lax.scan(step, (kv, delta), jnp.arange(n - 1, dtype=jnp.int32))
    return delta + part(kv, jnp.int32(n - 1))


def _kernel_or_einsum_grads(cfg: RingConfig, q, dout, lse, delta, row_sum, rank, q_pos, kvb,
                            step):
    """(dq, dkv) fp32 of this rank's queries against the block (K and V
    stacked) that started on rank - step: the block kernel's or einsums'."""
    k_rank = (rank - step) % cfg.n
    if cfg.block_grads == "kernel":
        dq_s, dk_s, dv_s = block_bwd.block_bwd(q, dout, lse, delta, kvb[0], kvb[1], rank,
                                               k_rank, cfg)
    else:
        k_pos = reference.positions(k_rank, cfg.n, kvb.shape[2], cfg.layout)
        dq_s, dk_s, dv_s = reference.attention_block_grads(
            q, dout, lse, delta, kvb[0], kvb[1], q_pos, k_pos, causal=cfg.causal,
            scale=cfg.scale, row_sum=row_sum)
    return dq_s, jnp.stack([dk_s, dv_s])


# ---- the fused call ------------------------------------------------------------
ring_attention_bwd_p = Primitive("pk_ring_attention_bwd")
ring_attention_bwd_p.multiple_results = True


def fused_backward(cfg: RingConfig, q, dout, lse, delta, k, v):
    """(dq fp32, dk, dv of k's dtype) by one pk_ring_attention_bwd call
    (cfg.n >= 2, shapes the block kernel takes)."""
    args = (q, dout, lse.astype(jnp.float32), delta.astype(jnp.float32), k, v,
            jnp.arange(cfg.n, dtype=jnp.int32))
    dq, dk, dv, _ = ring_attention_bwd_p.bind(*vary_alike(*args, names=cfg.names), cfg=cfg)
    return dq, dk, dv


def _abstract(q, dout, lse, delta, k, v, ranks, *, cfg: RingConfig):
    return (q.update(dtype=jnp.float32), k.update(), v.update(),
            result_aval(k, (scratch_bytes(k.shape),), dtype=jnp.uint8))


def _reference(ctx, q, dout, lse, delta, k, v, ranks, *, cfg: RingConfig):
    def fn(q, dout, lse, delta, k, v, ranks):
        dq, dk, dv = ppermute_backward(cfg, q, dout, lse, delta, k, v)
        scratch = make_varying(jnp.zeros((scratch_bytes(k.shape),), jnp.uint8),
                               reference.ring_axes(cfg.names, q))
        return dq, dk, dv, scratch
    return mlir.lower_fun(fn, multiple_results=True)(ctx, q, dout, lse, delta, k, v, ranks)


def _cuda(ctx, q, dout, lse, delta, k, v, ranks, *, cfg: RingConfig):
    table = kernel_group(ctx, "ring_attention", cfg.names, cfg.n, need_cutlass=True,
                         forced=cfg.mechanism if cfg.forced else None)
    if table is None:
        return _reference(ctx, q, dout, lse, delta, k, v, ranks, cfg=cfg)
    k_shape = ctx.avals_in[4].shape
    try:
        attr = channel_attr(table, "ring_attention_bwd", block_layout(ctx.avals_in[4]),
                            region_bytes(cfg.n, k_shape))
    except PkJaxError as e:  # the staging region does not fit the workspace
        warn_once(f"ring_attention_bwd-region-{k_shape}",
                  f"pk_jax.ring_attention: the fused backward's staging (8 bytes per element "
                  f"of one K block, {region_bytes(cfg.n, k_shape)} bytes, any ring size) does "
                  f"not fit ({e}); this backward uses XLA's collective-permutes between the "
                  "block kernels")
        return _reference(ctx, q, dout, lse, delta, k, v, ranks, cfg=cfg)
    return jax.ffi.ffi_lowering("pk_ring_attention_bwd")(
        ctx, q, dout, lse, delta, k, v, ranks, scale=np.float32(cfg.scale),
        causal=bool(cfg.causal), zigzag=cfg.layout == "zigzag", **attr)


ring_attention_bwd_p.def_abstract_eval(_abstract)
mlir.register_lowering(ring_attention_bwd_p, _reference)
mlir.register_lowering(ring_attention_bwd_p, _cuda, platform="cuda")
