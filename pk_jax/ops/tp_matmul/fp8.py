"""The FP8 paths of the tensor-parallel matmuls (internal: the public entry
is the `fp8=` argument of pk_jax.all_gather_matmul, matmul_reduce_scatter and
matmul_all_reduce).

Each op quantizes its operands with pk's quantization kernel, moves the
quantized rows and their factors with pk's collectives (half the bytes of
bf16) and runs pk's scaled FP8 GEMMs (pk_jax/ops/fp8/), forward and both
gradients; sums (reduce-scatter, all-reduce) travel and add in the output
dtype with fp32 accumulation. Per-tensor factors of a gathered operand are
shared by the whole axis: the scale comes from the axis-wide amax (a pmax of
one float), so the gathered rows form one FP8 operand with one factor.
Block factors travel with their rows.

With a bfloat16 result the FP8 GEMMs run inside the bf16 ops' host
sequences (primitive.py's *_fp8 primitives), per-tensor and block factors
alike: the quantized rows feed the chunk GEMMs as the copy engines land them
(all_gather_matmul; block factors travel in the same slot, after their
rows), the partial products go straight to their owners
(matmul_reduce_scatter, matmul_all_reduce), and each backward's dx runs the
other op's sequence; the weight gradients are local FP8 GEMMs on the FP8
copies gathered along the tokens. A sequence's GEMM of a chunk of rows reads
the chunk's block factors [K/128, m] contiguous, so an operand whose rows a
sequence splits into n chunks (x in matmul_reduce_scatter and chunked
matmul_all_reduce, dy in all_gather_matmul's backward) is quantized with
its factors in n row groups ([n * K/128, m]: fp8_quantize's row_groups).
Other output types compose the collectives and GEMMs one after the other.

A stored operand (`Fp8Weight`, `Fp8Activation`: each rank's shard as
stored) enters the GEMMs as it is; its cotangent is zero. An activation that
all_gather_matmul gathers with one tensor factor needs that factor to be the
same on every rank (api.py checks its type).

Delayed scaling: the caller's scales (x, w, dy) quantize the operands; each
op returns (y, (amax(x), amax(w))) and carries amax(dy) as the cotangent of
the dy scale, as `fp8_dot` does. Every operand here is sharded over the
axis (or, the all-reduce's dy, replicated), so each amax is the axis-wide
one (`fp8.max_to_type_of`, by pk's all_reduce), and also the maximum over
any other mesh axis its scale is replicated over.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import tuning
from pk_jax._compat import make_varying, sum_to_type_of
from pk_jax.ops.fp8 import api as fp8_ops
from pk_jax.ops.all_gather import all_gather
from pk_jax.ops.all_reduce import all_reduce, reduce_scatter
from pk_jax.ops.tp_matmul.primitive import (TpConfig, all_gather_matmul_fp8_p,
                                            fp8_row_groups, matmul_all_reduce_fp8_p,
                                            matmul_reduce_scatter_fp8_p)

Recipe = fp8_ops.Fp8Recipe


def check(op: str, x, w, recipe: Recipe, n: int, rows_per_rank: Optional[int]) -> None:
    """What the FP8 paths need of the shapes (ValueError naming the dim)."""
    k, cols = x.shape[-1], w.shape[1]
    mult = 128 if recipe.scaling == "block" else 16
    for name, v in (("K (x.shape[-1])", k), ("N (w.shape[1])", cols)):
        if v % mult:
            raise ValueError(f"pk_jax.{op}(fp8={recipe.scaling!r}): {name}={v} must be a "
                             f"multiple of {mult}")
    rows = rows_per_rank
    if rows is not None and rows % (128 if recipe.scaling == "block" else 16):
        raise ValueError(f"pk_jax.{op}(fp8={recipe.scaling!r}): the rows per device ({rows}) "
                         f"must be a multiple of {128 if recipe.scaling == 'block' else 16}")


def _gather(a, names, n: int, axis: int = 0):
    return a if n == 1 or a is None else all_gather(a, names, axis=axis, tiled=True)


def _scatter(a, names, n: int):
    return a if n == 1 else reduce_scatter(a, names, scatter_dimension=0, tiled=True)


def _axis_scale(x, names, n: int, dtype, margin: float):
    """The scale of a tensor sharded over the axis: fp8_max * 2^-margin over
    the axis-wide amax (1 where it is 0). The n amaxes travel by pk's
    all_gather (no XLA collective: it also runs where NCCL cannot, e.g.
    two processes sharing a GPU)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    if n > 1:
        amax = jnp.max(all_gather(amax.reshape(1), names, tiled=True))
    return fp8_ops.scale_from_amax(amax, dtype, margin)


def _out(dtype):
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def _quantize_rows_sharded(x, names, n: int, recipe: Recipe, dtype, *, rowwise=True,
                           transposed=False, scale=None, row_groups: int = 1,
                           transposed_blocks: bool = False):
    """Quantize this rank's rows of an operand gathered along its rows:
    (q, qt, factors of q, factors of qt, amax) as `fp8.activation_operands`
    gives them, tensor factors from the given scale (delayed scaling) or the
    axis-wide amax (an `Fp8Activation` as stored); block factors of q in
    `row_groups` row groups, of qt per 128x128 with `transposed_blocks`.
    amax: this rank's amax(x) with per-tensor factors (what delayed scaling
    records), else None."""
    if recipe.scaling != "block" and scale is None and not fp8_ops.is_stored(x):
        scale = _axis_scale(x, names, n, dtype, recipe.margin)
    return fp8_ops.activation_operands(x, recipe, dtype, rowwise=rowwise,
                                       transposed=transposed, scale=scale,
                                       row_groups=row_groups,
                                       transposed_blocks=transposed_blocks)


def _gemm(a, b, fa, fb, recipe: Recipe, out_dtype, b_row_blocks=False):
    return fp8_ops.fp8_matmul(a, b, fa, fb, scaling=recipe.gemm_scaling, b_row_blocks=b_row_blocks,
                              out_dtype=_out(out_dtype),
                              fast_accum=recipe.fast_gradient_accumulation).astype(out_dtype)


def _quantize_local(a, recipe: Recipe, dtype, *, rowwise=True, transposed=False, scale=None,
                    row_groups: int = 1, transposed_blocks: bool = False):
    """A rank-local operand (no axis-wide scale): as `_quantize_rows_sharded`,
    block factors of the row-wise copy in `row_groups` row groups (the row
    chunks of a host sequence's GEMMs)."""
    return _quantize_rows_sharded(a, (), 1, recipe, dtype, rowwise=rowwise,
                                  transposed=transposed, scale=scale, row_groups=row_groups,
                                  transposed_blocks=transposed_blocks)


def _gather_transposed(qt, fqt, names, n: int, recipe: Recipe):
    """The transposed copy of an operand quantized by `_quantize_rows_sharded`
    gathered along its rows (axis 1) with its factors: block ones [rows/128,
    K] along axis 0; a per-tensor factor is already the axis's."""
    return (_gather(qt, names, n, axis=1),
            _gather(fqt, names, n, axis=0) if recipe.scaling == "block" else fqt)


def _gather_rows(q, qt, fq, fqt, amax, names, n: int, recipe: Recipe):
    """An operand quantized by `_quantize_rows_sharded`, gathered along its
    rows: the row-wise copy (axis 0) with its block factors ([K/128, rows]
    along axis 1), and the transposed copy (`_gather_transposed`). amax
    stays this rank's."""
    qt, fqt = _gather_transposed(qt, fqt, names, n, recipe)
    return (_gather(q, names, n), qt,
            _gather(fq, names, n, axis=1) if recipe.scaling == "block" else fq, fqt, amax)


def _fused(recipe: Recipe, out_dtype) -> bool:
    """Whether the FP8 GEMMs run inside the TP host sequences (the bf16 ops'
    overlap, on FP8 operands): with a bfloat16 result (the sequences' GEMM
    epilogues add the peers' partials in it), per-tensor or block factors."""
    return jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)


def _row_groups(prim, recipe: Recipe, n: int, mechanism: str, fused: bool) -> int:
    """The row groups of an operand's block factors as the sequence of `prim`
    reads them where it runs (`fp8_row_groups`); 1 where it does not."""
    return fp8_row_groups(prim, n, mechanism) if fused and recipe.scaling == "block" else 1


def _sequence(prim, names, n: int, out_dtype, mechanism: str, recipe: Recipe, a, b, fa, fb):
    """One FP8 host sequence (primitive.py's *_fp8 primitives) on a
    [rows, K] and b [N, K] with their factors (block: a's in the sequence's
    row groups, `_row_groups`); the operands vary over the axis as the
    primitives require."""
    operands = (make_varying(t, tuple(names)) for t in (a, b, fa, fb))
    cfg = TpConfig(tuple(names), n, np.dtype(out_dtype), mechanism)
    return prim.bind(*operands, cfg=cfg, scaling=recipe.gemm_scaling,
                     fast_accum=recipe.fast_gradient_accumulation)


def _local_operands(x, w, sx, sw, recipe: Recipe, residuals: bool, row_groups: int = 1):
    """This rank's FP8 operands of x @ w (x [M, K_local]): (q, w^T, their
    factors: x's block ones in `row_groups` row groups), the backward's
    residuals (x^T and w quantized, with their factors, where `residuals`
    asks and a gradient reads them) and the local amaxes of x and w."""
    xt_copy, w_copy = fp8_ops.residual_copies(x, w, residuals)
    q, qt, fq, fqt, ax = _quantize_local(x, recipe, recipe.fwd_dtype, transposed=xt_copy,
                                         scale=sx, row_groups=row_groups)
    wq, wt, fw_fwd, fw_bwd, aw = fp8_ops.weight_operands(w, recipe, sw, dgrad=w_copy)
    return (q, wt, fq, fw_fwd), (qt, fqt, wq, fw_bwd, fp8_ops.marker(x),
                                 fp8_ops.marker(w)), (ax, aw)


def _grads(quantized_dy, res, recipe: Recipe, dx_of=None):
    """(dx, dw, amax(dy)) with dx, dw typed like (x, w): dx = dx_of(dy, w,
    their factors, dtype) (default: the local FP8 GEMM dy w^T), dw = x^T dy,
    each None for a stored operand (marker None), from the quantized dy (q,
    qt, their factors, its amax) and the forward's residuals."""
    dq, dt, fdq, fdt, ady = quantized_dy
    qt, fqt, wq, fw_bwd, xm, wm = res
    dx_of = dx_of or (lambda a, b, fa, fb, dtype: _gemm(a, b, fa, fb, recipe, dtype))
    dx = None if xm is None else sum_to_type_of(dx_of(dq, wq, fdq, fw_bwd, xm.dtype), xm)
    dw = None if wm is None else sum_to_type_of(
        _gemm(qt, dt, fqt, fdt, recipe, wm.dtype, b_row_blocks=recipe.wgrad_row_blocks), wm)
    return dx, dw, ady


def _dy_copies(res, recipe: Recipe) -> dict:
    """How to quantize dy: the copies the gradients read (the row-wise one
    for dx: x not stored; the transposed one for dw: w not stored), and the
    transposed one's blocks (Fp8Recipe.wgrad_dy_blocks)."""
    return dict(rowwise=res[4] is not None, transposed=res[5] is not None,
                transposed_blocks=recipe.wgrad_dy_blocks)


def _op(forward, backward, doc: str):
    """An FP8 op (x, w, scales, names, n, recipe, out_dtype) -> (y, amaxes)
    with its custom_vjp, from forward(x, w, sx, sw, names, n, recipe,
    out_dtype, residuals) -> (y, residuals (the backward's copies only
    where `residuals`: not in the primal), (amax(x), amax(w))) and backward(names, n,
    recipe, out_dtype, residuals, dy, sdy) -> (dx, dw, amax(dy)). scales:
    None (current and block scaling; amaxes None) or the delayed scales
    (x, w, dy), each [1] float32: amaxes are then the axis-wide amax(x),
    amax(w), and the scales' cotangent carries the axis-wide amax(dy)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
    def op(x, w, scales, names, n: int, recipe: Recipe, out_dtype):
        return op_fwd(x, w, scales, names, n, recipe, out_dtype, residuals=False)[0]

    def op_fwd(x, w, scales, names, n, recipe, out_dtype, residuals=True):
        sx, sw, _ = (None,) * 3 if scales is None else scales
        y, res, (ax, aw) = forward(x, w, sx, sw, names, n, recipe, out_dtype, residuals)
        amaxes = None if scales is None else (fp8_ops.max_to_type_of(ax, sx, names),
                                              fp8_ops.max_to_type_of(aw, sw, names))
        return (y, amaxes), (res, scales)

    def op_bwd(names, n, recipe, out_dtype, carry, cts):
        res, scales = carry
        if res[4] is None and res[5] is None:  # both operands stored: constants
            return None, None, None
        dy, _ = cts  # the amaxes are not differentiated
        dx, dw, ady = backward(names, n, recipe, out_dtype, res, dy,
                               None if scales is None else scales[2])
        return dx, dw, None if scales is None else fp8_ops.scale_cotangents(scales, ady, names)

    op.defvjp(op_fwd, op_bwd)
    op.__doc__ = doc
    return op


# ---- all_gather_matmul -------------------------------------------------------------
def _ag_fwd(x, w, sx, sw, names, n, recipe, out_dtype, residuals):
    xt_copy, w_copy = fp8_ops.residual_copies(x, w, residuals)
    q, qt, fq, fqt, ax = _quantize_rows_sharded(x, names, n, recipe, recipe.fwd_dtype,
                                                transposed=xt_copy, scale=sx)
    wq, wt, fw_fwd, fw_bwd, aw = fp8_ops.weight_operands(w, recipe, sw, dgrad=w_copy)
    if _fused(recipe, out_dtype):  # the rows (and block factors) gathered inside the sequence
        y = _sequence(all_gather_matmul_fp8_p, names, n, out_dtype, "chunked", recipe, q, wt,
                      fq, fw_fwd)
        qt, fqt = _gather_transposed(qt, fqt, names, n, recipe)
    else:
        q, qt, fq, fqt, ax = _gather_rows(q, qt, fq, fqt, ax, names, n, recipe)
        y = _gemm(q, wt, fq, fw_fwd, recipe, out_dtype)
    # the weight gradient reads x^T gathered along the tokens
    return y, (qt, fqt, wq, fw_bwd, fp8_ops.marker(x), fp8_ops.marker(w)), (ax, aw)


def _ag_bwd(names, n, recipe, out_dtype, res, dy, sdy):
    # dy [n m, N_local] is local to this rank's column shard; dy w^T [n m, K]
    # is reduce-scattered to this rank's rows (matmul_reduce_scatter's
    # sequence where it runs: dy's block factors in its n row chunks)
    fused = res[4] is not None and _fused(recipe, res[4].dtype)
    groups = _row_groups(matmul_reduce_scatter_fp8_p, recipe, n, "chunked", fused)

    def dx_of(a, b, fa, fb, dtype):
        if fused:
            return _sequence(matmul_reduce_scatter_fp8_p, names, n, dtype, "chunked", recipe,
                             a, b, fa, fb)
        return _scatter(_gemm(a, b, fa, fb, recipe, dtype), names, n)
    return _grads(_quantize_local(dy, recipe, recipe.bwd_dtype, scale=sdy, row_groups=groups,
                                  **_dy_copies(res, recipe)), res, recipe, dx_of)


all_gather_matmul = _op(_ag_fwd, _ag_bwd, """all_gather(x, tiled) @ w with FP8 GEMMs: x
    [m, K] this rank's rows.""")


# ---- matmul_reduce_scatter ---------------------------------------------------------
def _rs_fwd(x, w, sx, sw, names, n, recipe, out_dtype, residuals):
    fused = _fused(recipe, out_dtype)
    groups = _row_groups(matmul_reduce_scatter_fp8_p, recipe, n, "chunked", fused)
    operands, res, amaxes = _local_operands(x, w, sx, sw, recipe, residuals, groups)
    if fused:
        return _sequence(matmul_reduce_scatter_fp8_p, names, n, out_dtype, "chunked", recipe,
                         *operands), res, amaxes
    return _scatter(_gemm(*operands, recipe, out_dtype), names, n), res, amaxes


def _rs_bwd(names, n, recipe, out_dtype, res, dy, sdy):
    # dy [M / n, N] this rank's rows, gathered in FP8: row-wise for dx (inside
    # all_gather_matmul's sequence where it runs), the transposed copy along
    # the tokens for dw
    dq, dt, fdq, fdt, ady = _quantize_rows_sharded(dy, names, n, recipe, recipe.bwd_dtype,
                                                   scale=sdy, **_dy_copies(res, recipe))
    if res[4] is not None and _fused(recipe, res[4].dtype):
        def dx_of(a, b, fa, fb, dtype):
            return _sequence(all_gather_matmul_fp8_p, names, n, dtype, "chunked", recipe, a, b,
                             fa, fb)
        dt, fdt = _gather_transposed(dt, fdt, names, n, recipe)
        return _grads((dq, dt, fdq, fdt, ady), res, recipe, dx_of)
    return _grads(_gather_rows(dq, dt, fdq, fdt, ady, names, n, recipe), res, recipe)


matmul_reduce_scatter = _op(_rs_fwd, _rs_bwd, """psum_scatter(x @ w, tiled) with FP8 GEMMs:
    x [M, K_local].""")


# ---- matmul_all_reduce -------------------------------------------------------------
def _ar_fwd(x, w, sx, sw, names, n, recipe, out_dtype, residuals):
    fused = _fused(recipe, out_dtype)
    mechanism = tuning.matmul_all_reduce_mechanism(x.shape[0], n)
    groups = _row_groups(matmul_all_reduce_fp8_p, recipe, n, mechanism, fused)
    operands, res, amaxes = _local_operands(x, w, sx, sw, recipe, residuals, groups)
    if fused:
        return _sequence(matmul_all_reduce_fp8_p, names, n, out_dtype, mechanism, recipe,
                         *operands), res, amaxes
    # also at n = 1: psum's invariant type
    return all_reduce(_gemm(*operands, recipe, out_dtype), names), res, amaxes


def _ar_bwd(names, n, recipe, out_dtype, res, dy, sdy):
    """psum's transpose: every rank gets the full (invariant) dy; both
    gradients are local FP8 GEMMs."""
    return _grads(_quantize_local(make_varying(dy, names), recipe, recipe.bwd_dtype,
                                  scale=sdy, **_dy_copies(res, recipe)), res, recipe)


matmul_all_reduce = _op(_ar_fwd, _ar_bwd, """psum(x @ w) with an FP8 GEMM: x [M, K_local];
    every rank gets the same bits.""")
