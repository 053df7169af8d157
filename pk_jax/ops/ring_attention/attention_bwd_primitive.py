"""The primitive of the flash-attention backward of one ring step.

`pk_attention_block_bwd`: the gradient contributions of one K/V block to the
queries of this rank, with the probabilities recomputed from the forward's
log-sum-exp (what `pk_jax.reference.attention_block_grads` computes):

    q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] float32, where
    delta' = rowsum(dout * out) - dlse; k, v [B, T, Hkv, D]; q_rank, k_rank
    int32 scalars (the ranks owning the query block and the K/V block: the
    ring step is a scan variable, so k_rank is traced)
    -> dq [B, S, Hq, D] float32, dk, dv [B, T, Hkv, D] of `grad_dtype`
       (float32 for a ring step's share, summed later; k's dtype where the
       block's gradients are final, a ring of one; summed over the query
       heads of each GQA group).

Causal masks compare global token positions (`reference.positions`:
contiguous or zigzag over a ring of `cfg.n`). Lowering: on CUDA with the
extension built with CUTLASS, the FFI kernel of xla_ffi/attention_bwd.cc (a
Hopper FMHA backward; tiles the mask hides wholly are skipped); anywhere else
`reference.attention_block_grads`. Which shapes the kernel takes is decided
before binding (`kernel_problem`). Determinism: dk and dv are; dq is summed
over K/V tiles with fp32 reduce-adds in arrival order, so it can differ in
the last bits from run to run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import reference
from pk_jax._compat import vary_alike
from pk_jax.ops._lowering import kernels_missing
from pk_jax.ops.ring_attention.primitive import BWD_HEAD_DIMS, RingConfig, operand_problem

attention_block_bwd_p = Primitive("pk_attention_block_bwd")
attention_block_bwd_p.multiple_results = True

TILE_KV = 128  # K/V rows per CTA: kTileKv (csrc/kernels/attention_bwd/attention_bwd.h)


def tile_q(head_dim: int) -> int:
    """Query rows per inner tile (attention_bwd.h: tile_q)."""
    return 64 if head_dim == 128 else 128


def kernel_problem(q, k, layout: str) -> str | None:
    """None when the kernel takes this block pair, else why it does not."""
    if why := operand_problem(q, k, BWD_HEAD_DIMS):
        return why
    d = q.shape[3]
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} K/V heads"
    chunks = 2 if layout == "zigzag" else 1
    per = " (each zigzag chunk: half the rows)" if chunks == 2 else ""
    for what, rows, tile in (("S", q.shape[1], tile_q(d)), ("T", k.shape[1], TILE_KV)):
        if rows == 0 or rows % (chunks * tile):
            return (f"{what}={rows}: must be a multiple of {chunks * tile} for head_dim {d}"
                    f"{per}")
    return None


def block_bwd(q, dout, lse, delta, k, v, q_rank, k_rank, cfg: RingConfig,
              grad_dtype=jnp.float32):
    """(dq float32, dk, dv of `grad_dtype`) of one block pair; see the
    module docstring."""
    grad_dtype = jnp.dtype(grad_dtype)
    if grad_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(k.dtype)):
        raise ValueError(f"block_bwd: grad_dtype must be float32 or k's dtype {k.dtype}, "
                         f"got {grad_dtype}")
    args = (q, dout, lse.astype(jnp.float32), delta.astype(jnp.float32), k, v,
            jnp.asarray(q_rank, jnp.int32), jnp.asarray(k_rank, jnp.int32))
    # The outputs take q's and k's varying-axes type.
    return attention_block_bwd_p.bind(*vary_alike(*args), cfg=cfg, grad_dtype=grad_dtype)


# ---- abstract evaluation ------------------------------------------------------
def _abstract(q, dout, lse, delta, k, v, q_rank, k_rank, *, cfg: RingConfig, grad_dtype):
    return (q.update(dtype=jnp.float32), k.update(dtype=grad_dtype),
            v.update(dtype=grad_dtype))


# ---- reference lowering (every platform but CUDA) ------------------------------
def _reference(ctx, q, dout, lse, delta, k, v, q_rank, k_rank, *, cfg: RingConfig, grad_dtype):
    def fn(q, dout, lse, delta, k, v, q_rank, k_rank):
        q_pos = reference.positions(q_rank, cfg.n, q.shape[1], cfg.layout)
        k_pos = reference.positions(k_rank, cfg.n, k.shape[1], cfg.layout)
        dq, dk, dv = reference.attention_block_grads(
            q, dout, lse, delta, k, v, q_pos, k_pos, causal=cfg.causal, scale=cfg.scale)
        return dq, dk.astype(grad_dtype), dv.astype(grad_dtype)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, q, dout, lse, delta, k, v, q_rank,
                                                     k_rank)


# ---- CUDA lowering -----------------------------------------------------------
def _cuda(ctx, *args, cfg: RingConfig, grad_dtype):
    # The kernel needs CUTLASS like the GEMMs: the same build check.
    if kernels_missing("attention_block_bwd", need_cutlass=True):  # sets up the runtime
        return _reference(ctx, *args, cfg=cfg, grad_dtype=grad_dtype)
    return jax.ffi.ffi_lowering("pk_attention_block_bwd")(
        ctx, *args, scale=np.float32(cfg.scale), causal=bool(cfg.causal),
        zigzag=cfg.layout == "zigzag", n=np.int64(cfg.n))


attention_block_bwd_p.def_abstract_eval(_abstract)
mlir.register_lowering(attention_block_bwd_p, _reference)
mlir.register_lowering(attention_block_bwd_p, _cuda, platform="cuda")
