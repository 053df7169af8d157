"""Primitives of the tensor-parallel matmuls, on 2-D operands.

`pk_all_gather_matmul`:     x [m, K], w [K, N] -> (all_gather(x) @ w [n*m, N],
                                                   all_gather(x) [n*m, K] or [0, K])
`pk_matmul_reduce_scatter`: x [M, K], w [K, N] -> psum_scatter(x @ w) [M/n, N]
`pk_matmul_all_reduce`:     x [M, K], w [K, N] -> psum(x @ w) [M, N], invariant
                            over the axes (shard_map's check_vma) as psum's
                            result is

The backward passes of the first two, dx and dw in one call (the other op's
sequence with the weight gradient's GEMM placed where it would wait; w is
the forward's [K, N], read transposed in place):
`pk_all_gather_matmul_bwd`:     dy [n*m, N], w [K, N], gathered x [n*m, K]
                                -> (psum_scatter(dy @ w^T) [m, K],
                                    gathered^T @ dy [K, N])
`pk_matmul_reduce_scatter_bwd`: dy [m, N], w [K, N], x [n*m, K]
                                -> (all_gather(dy) @ w^T [n*m, K],
                                    x^T @ all_gather(dy) [K, N])
dx in cfg.out_dtype, dw in w's dtype, both accumulated in fp32. The operands
must vary over the same mesh axes (the callers pvary them).

The three forwards on FP8 operands (the fp8= paths of
pk_jax/ops/tp_matmul/fp8.py; the same host sequences, x's rows travel as FP8):
`pk_all_gather_matmul_fp8`, `pk_matmul_reduce_scatter_fp8`,
`pk_matmul_all_reduce_fp8`: x [rows, K] FP8, w^T [N, K] FP8 (K-major),
scale_x, scale_w -> as the 16-bit ops, in cfg.out_dtype (bfloat16). By the
parameter `scaling`: "tensor", one factor each ([1]); "block" (e4m3
operands), w's per 128x128 [ceil(K/128), ceil(N/128)] and x's per 1x128 in
the row groups of its GEMMs (`fp8_row_groups`: [g * ceil(K/128), rows / g],
fp8_quantize's row_groups layout); all_gather_matmul's x factors
[ceil(K/128), m] travel with the rows.

Parameters: the op's frozen `TpConfig`, and `transpose_w` (w is given as
[N, K] and the product is x @ w^T: the backward passes multiply by the
forward's weight transposed, and the kernels read it in place as a K-major
operand instead of XLA materializing w^T); all_gather_matmul also
`return_gathered`; the FP8 forwards `scaling` and `fast_accum` (per-tensor
products with an e5m2 operand without fp32 promotion where cuBLASLt runs
them: the recipe's fast_gradient_accumulation; the references compute in
fp32 either way).

Lowering: on CUDA with the extension built with CUTLASS and a kernel
mechanism ("chunked"; matmul_all_reduce also "one_shot"), the FFI kernels of
xla_ffi/tp_matmul.cc;
anywhere else the reference (pk_jax/reference.py). Differentiation lives one
level up (pk_jax/ops/tp_matmul/api.py, custom_vjp).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import reference
from pk_jax._compat import drop_varying, result_aval
from pk_jax.ops.fp8 import primitive as prim_fp8
from pk_jax.ops._lowering import channel_attr, kernel_group


# The kernels' mechanisms, in the order the ops list them (their MECHANISMS:
# "auto", these, "xla"): matmul_all_reduce's, the row-chunked kernels and the
# one-shot kernel (decode-sized M), with their ids in its FFI attribute
# `mechanism` (csrc/kernels/tp_matmul/tp_matmul.h: AllReduceMechanism); the
# other TP ops run the chunked kernels only (no mechanism attribute).
ALL_REDUCE_KERNEL_MECHANISMS = {"chunked": 0, "one_shot": 1}
KERNEL_MECHANISMS = tuple(m for m in ALL_REDUCE_KERNEL_MECHANISMS if m != "one_shot")


@dataclasses.dataclass(frozen=True)
class TpConfig:
    """Static part of one call, validated once (hashable: a custom_vjp static).

    Attributes:
      names: the mesh axes of the collective.
      n: the group size.
      out_dtype: the result dtype (accumulation is fp32 either way).
      mechanism: "chunked" or "one_shot" (the kernels; one_shot only for
        matmul_all_reduce) or "xla", resolved at trace time.
      forced: the user asked for `mechanism` (else "auto" chose it).
    """

    names: tuple[str, ...]
    n: int
    out_dtype: np.dtype
    mechanism: str
    forced: bool = False


all_gather_matmul_p = Primitive("pk_all_gather_matmul")
all_gather_matmul_p.multiple_results = True
matmul_reduce_scatter_p = Primitive("pk_matmul_reduce_scatter")
matmul_all_reduce_p = Primitive("pk_matmul_all_reduce")
all_gather_matmul_bwd_p = Primitive("pk_all_gather_matmul_bwd")
all_gather_matmul_bwd_p.multiple_results = True
matmul_reduce_scatter_bwd_p = Primitive("pk_matmul_reduce_scatter_bwd")
matmul_reduce_scatter_bwd_p.multiple_results = True


def _n_cols(w, transpose_w: bool) -> int:
    return w.shape[0] if transpose_w else w.shape[1]


def _region_bytes(n: int, rows: int, cols: int, dtype, extra: int = 0) -> int:
    """n slots of one rank's block [rows, cols] and `extra` bytes (the block
    factors that travel with FP8 rows) (tp_matmul.h: Params::region);
    nothing on one rank."""
    return n * (rows * cols * np.dtype(dtype).itemsize + extra) if n > 1 else 0


# ---- all_gather_matmul ----------------------------------------------------------
def _ag_abstract(x, w, *, cfg: TpConfig, return_gathered: bool, transpose_w: bool):
    m, k = x.shape
    rows = cfg.n * m if return_gathered else 0
    return (result_aval(x, (cfg.n * m, _n_cols(w, transpose_w)), dtype=cfg.out_dtype),
            result_aval(x, (rows, k)))


def _ag_reference(ctx, x, w, *, cfg: TpConfig, return_gathered: bool, transpose_w: bool):
    def fn(a, b):
        b = b.T if transpose_w else b
        out, gathered = reference.all_gather_matmul(a, b, cfg.names, out_dtype=cfg.out_dtype)
        return out, gathered if return_gathered else gathered[:0]
    return mlir.lower_fun(fn, multiple_results=True)(ctx, x, w)


def _group(ctx, op: str, cfg: TpConfig):
    """The axis's table when the kernels run it, else None (reference)."""
    if cfg.mechanism == "xla":
        return None
    return kernel_group(ctx, op, cfg.names, cfg.n, need_cutlass=True,
                        forced=cfg.mechanism if cfg.forced else None)


def _ag_cuda(ctx, x, w, *, cfg: TpConfig, return_gathered: bool, transpose_w: bool):
    table = _group(ctx, "all_gather_matmul", cfg)
    if table is None:
        return _ag_reference(ctx, x, w, cfg=cfg, return_gathered=return_gathered,
                             transpose_w=transpose_w)
    x_aval = ctx.avals_in[0]
    m, k = x_aval.shape
    attr = channel_attr(table, "all_gather_matmul", None, _region_bytes(cfg.n, m, k, x_aval.dtype))
    return jax.ffi.ffi_lowering("pk_all_gather_matmul")(
        ctx, x, w, return_gathered=bool(return_gathered), w_transposed=bool(transpose_w), **attr)


# ---- matmul_reduce_scatter --------------------------------------------------------
def _rs_abstract(x, w, *, cfg: TpConfig, transpose_w: bool):
    return result_aval(x, (x.shape[0] // cfg.n, _n_cols(w, transpose_w)), dtype=cfg.out_dtype)


def _rs_reference(ctx, x, w, *, cfg: TpConfig, transpose_w: bool):
    def fn(a, b):
        b = b.T if transpose_w else b
        return reference.matmul_reduce_scatter(a, b, cfg.names, out_dtype=cfg.out_dtype)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, w)


def _rs_cuda(ctx, x, w, *, cfg: TpConfig, transpose_w: bool):
    table = _group(ctx, "matmul_reduce_scatter", cfg)
    if table is None:
        return _rs_reference(ctx, x, w, cfg=cfg, transpose_w=transpose_w)
    x_aval, w_aval = ctx.avals_in
    attr = channel_attr(table, "matmul_reduce_scatter", None,
                        _region_bytes(cfg.n, x_aval.shape[0] // cfg.n,
                                      _n_cols(w_aval, transpose_w), cfg.out_dtype))
    return jax.ffi.ffi_lowering("pk_matmul_reduce_scatter")(
        ctx, x, w, w_transposed=bool(transpose_w), **attr)


# ---- matmul_all_reduce ------------------------------------------------------------
def _ar_abstract(x, w, *, cfg: TpConfig):
    return drop_varying(result_aval(x, (x.shape[0], w.shape[1]), dtype=cfg.out_dtype), cfg.names)


def _ar_reference(ctx, x, w, *, cfg: TpConfig):
    def fn(a, b):
        return reference.matmul_all_reduce(a, b, cfg.names, out_dtype=cfg.out_dtype)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, w)


def _ar_cuda(ctx, x, w, *, cfg: TpConfig):
    """chunked: two channels, the partial products' (n slots of [M/n, N]) and
    the reduced chunks' (the same); one_shot: one channel, n slots of [M, N]
    (`gather_channel` repeats it, unused)."""
    table = _group(ctx, "matmul_all_reduce", cfg)
    if table is None:
        return _ar_reference(ctx, x, w, cfg=cfg)
    attr = _ar_channels(table, cfg, ctx.avals_in[0].shape[0], ctx.avals_in[1].shape[1])
    return jax.ffi.ffi_lowering("pk_matmul_all_reduce")(ctx, x, w, **attr)


def _ar_channels(table, cfg: TpConfig, rows: int, cols: int) -> dict:
    """matmul_all_reduce's attributes for an output [rows, cols]: its channel
    (and the gather channel: chunked) and mechanism."""
    one_shot = cfg.mechanism == "one_shot"
    slot_rows = rows if one_shot else rows // cfg.n
    nbytes = _region_bytes(cfg.n, slot_rows, cols, cfg.out_dtype)
    reduce = channel_attr(table, "matmul_all_reduce", cfg.mechanism, nbytes)["channel"]
    gather = reduce if one_shot else channel_attr(table, "matmul_all_reduce", "gather",
                                                  nbytes)["channel"]
    return dict(channel=reduce, gather_channel=gather,
                mechanism=np.int32(ALL_REDUCE_KERNEL_MECHANISMS[cfg.mechanism]))


# ---- the backward passes: dx and dw in one call ------------------------------------
def weight_grad(act, rows, dtype):
    """act^T @ rows, accumulated in fp32, in `dtype` (the reference's dW)."""
    return lax.dot_general(act, rows, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)


def _bwd_cuda(ctx, operands, *, cfg: TpConfig, op: str, sequence: str, slot, ffi_lowering,
              reference_lowering):
    """The CUDA lowering of op's backward: `ffi_lowering` (its FFI call) with
    the channel of `sequence`, the op whose host sequence it runs (its region
    n slots of `slot`: rows, cols, dtype); `reference_lowering` where the
    kernels do not run op."""
    table = _group(ctx, op, cfg)
    if table is None:
        return reference_lowering(ctx, *operands, cfg=cfg)
    attr = channel_attr(table, sequence, None, _region_bytes(cfg.n, *slot))
    return ffi_lowering(ctx, *operands, **attr)


def _ag_bwd_abstract(dy, w, gathered, *, cfg: TpConfig):
    k = w.shape[0]
    return (result_aval(dy, (dy.shape[0] // cfg.n, k), dtype=cfg.out_dtype),
            result_aval(dy, w.shape, dtype=w.dtype))


def _ag_bwd_reference(ctx, dy, w, gathered, *, cfg: TpConfig):
    def fn(dy, w, gathered):
        dx = reference.matmul_reduce_scatter(dy, w.T, cfg.names, out_dtype=cfg.out_dtype)
        return dx, weight_grad(gathered, dy, w.dtype)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, dy, w, gathered)


def _ag_bwd_cuda(ctx, dy, w, gathered, *, cfg: TpConfig):
    """matmul_reduce_scatter's sequence and channel (dy @ w^T scattered),
    the dW GEMM before its wait."""
    dy_aval, w_aval = ctx.avals_in[:2]
    return _bwd_cuda(ctx, (dy, w, gathered), cfg=cfg, op="all_gather_matmul",
                     sequence="matmul_reduce_scatter",
                     slot=(dy_aval.shape[0] // cfg.n, w_aval.shape[0], cfg.out_dtype),
                     ffi_lowering=jax.ffi.ffi_lowering("pk_all_gather_matmul_bwd"),
                     reference_lowering=_ag_bwd_reference)


def _rs_bwd_abstract(dy, w, x, *, cfg: TpConfig):
    return (result_aval(dy, (cfg.n * dy.shape[0], w.shape[0]), dtype=cfg.out_dtype),
            result_aval(dy, w.shape, dtype=w.dtype))


def _rs_bwd_reference(ctx, dy, w, x, *, cfg: TpConfig):
    def fn(dy, w, x):
        dx, gathered = reference.all_gather_matmul(dy, w.T, cfg.names, out_dtype=cfg.out_dtype)
        return dx, weight_grad(x, gathered, w.dtype)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, dy, w, x)


def _rs_bwd_cuda(ctx, dy, w, x, *, cfg: TpConfig):
    """all_gather_matmul's sequence and channel (dy gathered, @ w^T), the dW
    GEMM on the gathered dy at the end."""
    dy_aval = ctx.avals_in[0]
    return _bwd_cuda(ctx, (dy, w, x), cfg=cfg, op="matmul_reduce_scatter",
                     sequence="all_gather_matmul", slot=(*dy_aval.shape, dy_aval.dtype),
                     ffi_lowering=jax.ffi.ffi_lowering("pk_matmul_reduce_scatter_bwd"),
                     reference_lowering=_rs_bwd_reference)


# ---- the FP8 forwards -----------------------------------------------------------------
all_gather_matmul_fp8_p = Primitive("pk_all_gather_matmul_fp8")
matmul_reduce_scatter_fp8_p = Primitive("pk_matmul_reduce_scatter_fp8")
matmul_all_reduce_fp8_p = Primitive("pk_matmul_all_reduce_fp8")


def fp8_row_groups(prim, n: int, mechanism: str) -> int:
    """The row groups of x's block factors in the FP8 sequence of `prim` (one
    GEMM per group of x's rows, which reads the group's factors
    [ceil(K/128), rows] contiguous: fp8_quantize's row_groups): n, the
    row chunks, for matmul_reduce_scatter and chunked matmul_all_reduce; 1
    for one_shot (one GEMM of all rows) and all_gather_matmul (this rank's
    rows travel with their factors)."""
    chunked = prim is matmul_reduce_scatter_fp8_p or (
        prim is matmul_all_reduce_fp8_p and mechanism != "one_shot")
    return n if chunked else 1


def _x_factor_bytes(scaling: str, rows: int, k: int) -> int:
    """The bytes of the block factors of `rows` rows of x (0 per-tensor)."""
    return 4 * rows * prim_fp8.blocks(k) if scaling == "block" else 0


def _fp8_product(a, wt, sx, sw, cfg: TpConfig, scaling: str, groups: int = 1):
    """a @ wt^T scaled by the factors (what the sequences' GEMMs compute):
    per-tensor, or block factors with a's in `groups` row groups."""
    if scaling == "block":
        sx = prim_fp8.ungroup_rows(sx, groups)
    return prim_fp8.matmul_reference(a, wt, sx, sw, scaling=scaling, b_row_blocks=False,
                                     out_dtype=cfg.out_dtype)


def _fp8_call(lowering, ctx, x, wt, sx, sw, scaling: str, fast_accum: bool, attr: dict):
    """An FP8 sequence's FFI call (`lowering`, its jax.ffi.ffi_lowering):
    the operands, the op's channel attributes and the GEMMs' attributes
    (prim_fp8.gemm_attributes)."""
    return lowering(ctx, x, wt, sx, sw, **prim_fp8.gemm_attributes(scaling, fast_accum), **attr)


def _ag_fp8_abstract(x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                     fast_accum: bool):
    return result_aval(x, (cfg.n * x.shape[0], wt.shape[0]), dtype=cfg.out_dtype)


def _ag_fp8_reference(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                      fast_accum: bool):
    def fn(x, wt, sx, sw):
        if scaling == "block":  # [ceil(K/128), m] each: gathered along the rows
            sx = reference.all_gather(sx, cfg.names, axis=1, tiled=True)
        return _fp8_product(reference.all_gather(x, cfg.names, tiled=True), wt, sx, sw, cfg,
                            scaling)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, wt, sx, sw)


def _ag_fp8_cuda(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                 fast_accum: bool):
    """A slot holds one rank's rows and, with block factors, their factors
    after them (tp_matmul.h)."""
    table = _group(ctx, "all_gather_matmul", cfg)
    if table is None:
        return _ag_fp8_reference(ctx, x, wt, sx, sw, cfg=cfg, scaling=scaling,
                                 fast_accum=fast_accum)
    m, k = ctx.avals_in[0].shape
    nbytes = _region_bytes(cfg.n, m, k, ctx.avals_in[0].dtype, _x_factor_bytes(scaling, m, k))
    attr = channel_attr(table, "all_gather_matmul", None, nbytes)
    return _fp8_call(jax.ffi.ffi_lowering("pk_all_gather_matmul_fp8"), ctx, x, wt, sx, sw,
                     scaling, fast_accum, attr)


def _rs_fp8_abstract(x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                     fast_accum: bool):
    return result_aval(x, (x.shape[0] // cfg.n, wt.shape[0]), dtype=cfg.out_dtype)


def _rs_fp8_reference(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                      fast_accum: bool):
    groups = fp8_row_groups(matmul_reduce_scatter_fp8_p, cfg.n, cfg.mechanism)

    def fn(x, wt, sx, sw):
        return reference.reduce_scatter(_fp8_product(x, wt, sx, sw, cfg, scaling, groups),
                                        cfg.names, tiled=True)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, wt, sx, sw)


def _rs_fp8_cuda(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                 fast_accum: bool):
    table = _group(ctx, "matmul_reduce_scatter", cfg)
    if table is None:
        return _rs_fp8_reference(ctx, x, wt, sx, sw, cfg=cfg, scaling=scaling,
                                 fast_accum=fast_accum)
    rows, cols = ctx.avals_in[0].shape[0], ctx.avals_in[1].shape[0]
    attr = channel_attr(table, "matmul_reduce_scatter", None,
                        _region_bytes(cfg.n, rows // cfg.n, cols, cfg.out_dtype))
    return _fp8_call(jax.ffi.ffi_lowering("pk_matmul_reduce_scatter_fp8"), ctx, x, wt, sx, sw,
                     scaling, fast_accum, attr)


def _ar_fp8_abstract(x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                     fast_accum: bool):
    return drop_varying(result_aval(x, (x.shape[0], wt.shape[0]), dtype=cfg.out_dtype),
                        cfg.names)


def _ar_fp8_reference(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                      fast_accum: bool):
    groups = fp8_row_groups(matmul_all_reduce_fp8_p, cfg.n, cfg.mechanism)

    def fn(x, wt, sx, sw):
        return reference.all_reduce(_fp8_product(x, wt, sx, sw, cfg, scaling, groups),
                                    cfg.names)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, wt, sx, sw)


def _ar_fp8_cuda(ctx, x, wt, sx, sw, *, cfg: TpConfig, scaling: str,
                 fast_accum: bool):
    table = _group(ctx, "matmul_all_reduce", cfg)
    if table is None:
        return _ar_fp8_reference(ctx, x, wt, sx, sw, cfg=cfg, scaling=scaling,
                                 fast_accum=fast_accum)
    attr = _ar_channels(table, cfg, ctx.avals_in[0].shape[0], ctx.avals_in[1].shape[0])
    return _fp8_call(jax.ffi.ffi_lowering("pk_matmul_all_reduce_fp8"), ctx, x, wt, sx, sw,
                     scaling, fast_accum, attr)


def _register(prim, abstract, reference_lowering, cuda_lowering):
    """The abstract evaluation, the reference lowering everywhere and the
    kernels' on CUDA."""
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, reference_lowering)
    mlir.register_lowering(prim, cuda_lowering, platform="cuda")


_register(all_gather_matmul_p, _ag_abstract, _ag_reference, _ag_cuda)
_register(matmul_reduce_scatter_p, _rs_abstract, _rs_reference, _rs_cuda)
_register(matmul_all_reduce_p, _ar_abstract, _ar_reference, _ar_cuda)
_register(all_gather_matmul_bwd_p, _ag_bwd_abstract, _ag_bwd_reference, _ag_bwd_cuda)
_register(matmul_reduce_scatter_bwd_p, _rs_bwd_abstract, _rs_bwd_reference, _rs_bwd_cuda)
_register(all_gather_matmul_fp8_p, _ag_fp8_abstract, _ag_fp8_reference, _ag_fp8_cuda)
_register(matmul_reduce_scatter_fp8_p, _rs_fp8_abstract, _rs_fp8_reference, _rs_fp8_cuda)
_register(matmul_all_reduce_fp8_p, _ar_fp8_abstract, _ar_fp8_reference, _ar_fp8_cuda)
