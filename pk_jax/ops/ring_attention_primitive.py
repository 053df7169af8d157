"""The primitive of the fused ring attention forward.

`pk_ring_attention`: q [B, S, Hq, D], k, v [B, S, Hkv, D] (this rank's tokens;
[B, Hkv, S, D] with kv_head_major) -> (out [B, S, Hq, D], lse [B, Hq, S] float32).
Parameters: `cfg` (its mechanism "copy_engine" or "ld_st"), `num_comm_ctas`
(ld_st: the communicator CTAs; copy_engine: 0) and `kv_head_major` (K/V
handed head-major, posted in pieces by heads: copy_engine only).

Lowering: on CUDA with the extension built with CUTLASS, the FFI kernel of
xla_ffi/ring_attention.cc (copy engines, or communicator CTAs inside the
kernel for "ld_st", push K/V to every peer while one attention kernel walks
the whole ring); anywhere else the pure-JAX ring of
ring_attention_reference.py. Which shapes the kernel takes is decided before
binding (`kernel_problem`), so a bound primitive never falls back silently on
CUDA except when the extension itself is missing (with a one-time warning).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import runtime
from pk_jax.config import get_config
from pk_jax.ops._lowering import channel_attrs, group_table, kernels_missing
from pk_jax.ops.ring_attention_reference import RingConfig, ring_reference

ring_attention_p = Primitive("pk_ring_attention")
ring_attention_p.multiple_results = True

HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
TILE_Q = 128  # query rows per CTA (csrc/kernels/ring_attention/ring_attention.h)
MAX_PIECES = 8  # one stamp each: kMaxStamps in csrc/pk/layout.h
PIECE_BYTES = 4 << 20  # a peer's block is posted in pieces of about this size
# The kernel's mechanisms, as the FFI attribute `mechanism` spells them
# (csrc/kernels/ring_attention/ring_attention.h, enum Mechanism).
KERNEL_MECHANISMS = {"copy_engine": 0, "ld_st": 1}
DEFAULT_COMM_CTAS = 16  # ld_st communicator CTAs (kDefaultCommCtas)
MAX_COMM_CTAS = 32      # kMaxCommCtas


def operand_problem(q, k) -> str | None:
    """What the attention kernels (forward and block backward) need of the
    operands' dtypes and head dim: None, or why they do not take them."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernel takes bfloat16 and float16)"
    if k.dtype != q.dtype:
        return f"q is {q.dtype} but k/v are {k.dtype} (the kernel needs one dtype)"
    d = q.shape[3]
    if d not in HEAD_DIMS or k.shape[3] != d:
        return f"head_dim {d} (the kernel takes {HEAD_DIMS})"
    return None


def kernel_problem(q, k, cfg: RingConfig) -> str | None:
    """None when the fused kernel takes this call, else why it does not."""
    if why := operand_problem(q, k):
        return why
    s_local = q.shape[1]
    rows = s_local // 2 if cfg.layout == "zigzag" else s_local
    if s_local == 0 or rows % TILE_Q:
        per = "each zigzag chunk (S_local / 2)" if cfg.layout == "zigzag" else "S_local"
        return (f"S_local={s_local}: {per} must be a multiple of {TILE_Q} "
                f"(S_local a multiple of {2 * TILE_Q if cfg.layout == 'zigzag' else TILE_Q})")
    return None


def pieces(k_shape, by_heads: bool) -> int:
    """Pieces a peer's K (or V) block is posted in: ~PIECE_BYTES each, at most
    MAX_PIECES, dividing the block's units (rows, or (head, row) pairs when
    cut by heads; kv_walk.cuh's PiecePlan). Fixed per channel (part of its key)."""
    b, s_local, hkv, d = k_shape
    units = s_local * hkv if by_heads else s_local
    p = int(np.clip((b * s_local * hkv * d * 2) // PIECE_BYTES, 1, MAX_PIECES))
    while units % p:
        p -= 1
    return p


def region_bytes(n: int, k_shape) -> int:
    """The channel's data region: n - 1 peer blocks of K and of V."""
    return 2 * (n - 1) * int(np.prod(k_shape)) * 2 if n > 1 else 0


def _head_major(x):
    """[B, S, H, D] <-> [B, H, S, D]."""
    return jnp.swapaxes(x, 1, 2)


def fused_forward(q, k, v, cfg: RingConfig, num_comm_ctas: int) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of the fused kernel for [B, S, H, D] q/k/v; `num_comm_ctas`
    counts for ld_st only (the primitive carries 0 otherwise). For copy_engine
    with `pk_jax.configure(ring_piece_order="heads")` K and V go head-major
    first (one XLA transpose each) so the copy engines post them by head
    groups."""
    num_comm_ctas = int(num_comm_ctas) if cfg.mechanism == "ld_st" else 0
    head_major = (get_config().ring_piece_order == "heads" and cfg.n > 1
                  and cfg.mechanism == "copy_engine")
    if head_major:
        k, v = _head_major(k), _head_major(v)
    return tuple(ring_attention_p.bind(q, k, v, cfg=cfg, num_comm_ctas=num_comm_ctas,
                                       kv_head_major=head_major))


# ---- abstract evaluation ------------------------------------------------------
def _abstract(q, k, v, *, cfg: RingConfig, num_comm_ctas: int, kv_head_major: bool):
    b, s, hq, _ = q.shape
    return q.update(), q.update(shape=(b, hq, s), dtype=jnp.float32)


# ---- reference lowering (every platform but CUDA) ------------------------------
def _reference(ctx, q, k, v, *, cfg: RingConfig, num_comm_ctas: int, kv_head_major: bool):
    def fn(a, b, c):
        if kv_head_major:
            b, c = _head_major(b), _head_major(c)
        return ring_reference(a, b, c, cfg)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, q, k, v)


# ---- CUDA lowering -----------------------------------------------------------
def _cuda(ctx, q, k, v, *, cfg: RingConfig, num_comm_ctas: int, kv_head_major: bool):
    # The kernel needs CUTLASS like the GEMMs: the same build check.
    if kernels_missing("ring_attention", need_gemm=True):
        return _reference(ctx, q, k, v, cfg=cfg, num_comm_ctas=num_comm_ctas,
                          kv_head_major=kv_head_major)
    mechanism = KERNEL_MECHANISMS[cfg.mechanism]
    comm = num_comm_ctas  # 0 unless ld_st (fused_forward)
    b, x, y, d = ctx.avals_in[1].shape
    k_shape = (b, y, x, d) if kv_head_major else (b, x, y, d)  # [B, S, Hkv, D]
    _, table = group_table(ctx, "ring_attention", cfg.names, cfg.n)
    n_pieces = pieces(k_shape, kv_head_major)
    # Per mechanism: the ld_st arrival counters count `comm` adds per call.
    ch = runtime.channel(("ring_attention", cfg.mechanism, comm, table.tobytes(), n_pieces,
                          kv_head_major), region_bytes(cfg.n, k_shape))
    return jax.ffi.ffi_lowering("pk_ring_attention")(
        ctx, q, k, v, scale=np.float32(cfg.scale), causal=bool(cfg.causal),
        zigzag=cfg.layout == "zigzag", pieces=np.int64(n_pieces), kv_head_major=kv_head_major,
        mechanism=np.int64(mechanism), num_comm_ctas=np.int64(comm),
        **channel_attrs(table, ch))


ring_attention_p.def_abstract_eval(_abstract)
mlir.register_lowering(ring_attention_p, _reference)
mlir.register_lowering(ring_attention_p, _cuda, platform="cuda")
