"""The primitive of the fused ring attention forward, and the static config
that every ring attention primitive carries.

`pk_ring_attention`: q [B, S, Hq, D], k, v [B, S, Hkv, D] (this rank's tokens)
-> (out [B, S, Hq, D], lse [B, Hq, S] float32), with `cfg.mechanism`
"copy_engine" or "ld_st".

Lowering: on CUDA with the extension built with CUTLASS, the FFI kernel of
xla_ffi/ring_attention.cc (copy engines, or communicator CTAs inside the
kernel for "ld_st", push K/V to every peer while one attention kernel walks
the whole ring); anywhere else the pure-JAX ring (pk_jax/reference.py).
Which shapes the kernel takes is decided before binding (`kernel_problem`),
so a bound primitive never falls back on CUDA except when the extension
itself is missing (with a one-time warning).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import reference
from pk_jax._compat import result_aval
from pk_jax.ops._lowering import channel_attr, kernel_group

# The head dims the kernels take: supported() of csrc/kernels/ring_attention/
# ring_attention.cu (the forward) and of csrc/kernels/attention_bwd/
# attention_bwd.cu (the block backward, and so the fused ring backward).
HEAD_DIMS = (64, 128, 256)
BWD_HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
TILE_Q = 128  # query rows per CTA: kTileQ (csrc/kernels/ring_attention/ring_attention.h)
MAX_PIECES = 8  # pieces a peer's block is posted in: kMaxPieces
PIECE_BYTES = 4 << 20  # a peer's block is posted in pieces of about this size
# The kernel's mechanisms, in the order pk_jax.ring_attention lists them (its
# MECHANISMS: "auto", these, "xla", "cudnn"), as the FFI attribute `mechanism`
# spells them (ring_attention.h, enum Mechanism).
KERNEL_MECHANISMS = {"copy_engine": 0, "ld_st": 1}
DEFAULT_COMM_CTAS = 16  # ld_st communicator CTAs: kDefaultCommCtas
MAX_COMM_CTAS = 32      # kMaxCommCtas


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static part of one ring attention call, validated once.

    Attributes:
      names: the mesh axes the sequence is sharded over.
      n: the ring size.
      causal: mask keys at later global positions than the query.
      scale: the score scale.
      layout: "contiguous" or "zigzag" (which global tokens a rank holds).
      mechanism: "copy_engine" or "ld_st" (the fused kernel), "cudnn" (the
        ring of cuDNN blocks, cudnn.py) or "xla" (the
        pure-JAX ring), resolved at trace time.
      forced: the user asked for `mechanism` (else "auto" chose it).
      num_comm_ctas: ld_st's communicator CTAs; 0 for the other mechanisms.
      block_grads: how each step of the backward ring computes its block
        gradients: "kernel" (pk_attention_block_bwd), "cudnn" (cuDNN's
        backward with the ring's statistics) or "einsum".
      bwd_transport: how the backward moves K/V and the partial dK/dV: "pk"
        (one fused pk_ring_attention_bwd call, block_grads "kernel" only)
        or "xla" (collective-permutes between the steps).
    """

    names: tuple[str, ...]
    n: int
    causal: bool
    scale: float
    layout: str
    mechanism: str = "xla"
    forced: bool = False
    num_comm_ctas: int = 0
    block_grads: str = "einsum"
    bwd_transport: str = "xla"


def operand_problem(q, k, head_dims=HEAD_DIMS) -> str | None:
    """What an attention kernel (the forward: `head_dims` HEAD_DIMS; the
    block backward: BWD_HEAD_DIMS) needs of the operands' dtypes and head
    dim: None, or why it does not take them."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernel takes bfloat16 and float16)"
    if k.dtype != q.dtype:
        return f"q is {q.dtype} but k/v are {k.dtype} (the kernel needs one dtype)"
    d = q.shape[3]
    if d not in head_dims or k.shape[3] != d:
        return f"head_dim {d} (the kernel takes {head_dims})"
    return None


def kernel_problem(q, k, layout: str) -> str | None:
    """None when the fused forward kernel takes this call, else why it does not."""
    if why := operand_problem(q, k):
        return why
    s_local = q.shape[1]
    rows = s_local // 2 if layout == "zigzag" else s_local
    if s_local == 0 or rows % TILE_Q:
        per = "each zigzag chunk (S_local / 2)" if layout == "zigzag" else "S_local"
        return (f"S_local={s_local}: {per} must be a multiple of {TILE_Q} "
                f"(S_local a multiple of {2 * TILE_Q if layout == 'zigzag' else TILE_Q})")
    return None


def pieces(k_shape) -> int:
    """Pieces a peer's K (or V) block is posted in: ~PIECE_BYTES each, at most
    MAX_PIECES, dividing the block's rows (kv_walk.cuh's PiecePlan). Fixed
    per channel (part of its key)."""
    b, s_local, hkv, d = k_shape
    p = int(np.clip((b * s_local * hkv * d * 2) // PIECE_BYTES, 1, MAX_PIECES))
    while s_local % p:
        p -= 1
    return p


def block_layout(k_aval) -> tuple:
    """What a ring channel's key holds of the K/V blocks its calls stage (the
    forward's and the backward's): K's shape and element type."""
    return tuple(int(d) for d in k_aval.shape), str(k_aval.dtype)


def region_bytes(n: int, k_shape) -> int:
    """The channel's data region: n - 1 peer blocks of K and of V."""
    return 2 * (n - 1) * int(np.prod(k_shape)) * 2 if n > 1 else 0


ring_attention_p = Primitive("pk_ring_attention")
ring_attention_p.multiple_results = True


def _abstract(q, k, v, *, cfg: RingConfig):
    b, s, hq, _ = q.shape
    return q.update(), result_aval(q, (b, hq, s), dtype=jnp.float32)


def _reference(ctx, q, k, v, *, cfg: RingConfig):
    fn = lambda a, b, c: reference.ring_attention(a, b, c, cfg.names, n=cfg.n, causal=cfg.causal,
                                                  scale=cfg.scale, layout=cfg.layout)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, q, k, v)


def _cuda(ctx, q, k, v, *, cfg: RingConfig):
    # The kernel needs CUTLASS like the GEMMs: the same build check.
    table = kernel_group(ctx, "ring_attention", cfg.names, cfg.n, need_cutlass=True,
                         forced=cfg.mechanism if cfg.forced else None)
    if table is None:
        return _reference(ctx, q, k, v, cfg=cfg)
    k_shape = ctx.avals_in[1].shape
    n_pieces = pieces(k_shape)
    # The ld_st arrival counters count num_comm_ctas adds per call, and the
    # posts count pieces: both are part of the key. So is the K/V block's
    # layout (its stamps carry none): calls of two layouts that pair wrongly
    # wait on different channels, time out and poison their outputs instead
    # of reading each other's blocks.
    key = (cfg.mechanism, cfg.num_comm_ctas, n_pieces) + block_layout(ctx.avals_in[1])
    attr = channel_attr(table, "ring_attention", key, region_bytes(cfg.n, k_shape))
    return jax.ffi.ffi_lowering("pk_ring_attention")(
        ctx, q, k, v, scale=np.float32(cfg.scale), causal=bool(cfg.causal),
        zigzag=cfg.layout == "zigzag", pieces=np.int64(n_pieces),
        mechanism=np.int32(KERNEL_MECHANISMS[cfg.mechanism]),
        num_comm_ctas=np.int64(cfg.num_comm_ctas), **attr)


ring_attention_p.def_abstract_eval(_abstract)
mlir.register_lowering(ring_attention_p, _reference)
mlir.register_lowering(ring_attention_p, _cuda, platform="cuda")
