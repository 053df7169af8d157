"""The FP8 paths of the tensor-parallel matmuls (internal: the public entry
is the `fp8=` argument of pk_jax.all_gather_matmul, matmul_reduce_scatter and
matmul_all_reduce).

Each op quantizes its operands with pk's quantization kernel, moves the
quantized rows and their factors with pk's collectives (half the bytes of
bf16) and runs pk's scaled FP8 GEMMs (pk_jax/ops/fp8.py), forward and both
gradients; sums (reduce-scatter, all-reduce) travel and add in the output
dtype with fp32 accumulation. Per-tensor factors of a gathered operand are
shared by the whole axis: the scale comes from the axis-wide amax (a pmax of
one float), so the gathered rows form one FP8 operand with one factor.
Block factors travel with their rows. The communication here is not yet
overlapped with the GEMMs (the bf16 ops' host sequences do that).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pk_jax._compat import make_varying, sum_to_type_of
from pk_jax.ops import fp8 as fp8_ops
from pk_jax.ops import fp8_primitive as prim
from pk_jax.ops.all_gather import all_gather
from pk_jax.ops.all_reduce import all_reduce, reduce_scatter

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
    if recipe.scaling == "delayed":
        raise ValueError(f"pk_jax.{op}: fp8='delayed' needs the caller's scales; use "
                         "pk_jax.flax's layers (which keep the amax histories) or 'current'")


def _gather(a, names, n: int, axis: int = 0):
    return a if n == 1 else all_gather(a, names, axis=axis, tiled=True)


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
    fp8_max = prim.FP8_MAX[jnp.dtype(dtype)] * 2.0 ** -margin
    return jnp.where(amax == 0, jnp.float32(1), jnp.float32(fp8_max) / amax)


def _out(dtype):
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def _quantize_rows_sharded(x, names, n: int, recipe: Recipe, dtype, *, rowwise=True,
                           transposed=False):
    """Quantize this rank's rows of an operand gathered along its rows:
    (q, qt, factors); tensor factors from the axis-wide amax, block factors
    per 1x128 (q) and per 128x1 (qt, then factors [rows / 128, K])."""
    if recipe.scaling == "block":
        q = fq = qt = fqt = None
        if rowwise:
            q, _, fq, _ = fp8_ops.fp8_quantize(x, "rows", dtype)
        if transposed:
            _, qt, fqt, _ = fp8_ops.fp8_quantize(x, "cols", dtype, rowwise=False,
                                                 transposed=True)
        return q, qt, fq, fqt
    s = _axis_scale(x, names, n, dtype, recipe.margin)
    q, qt, f, _ = fp8_ops.fp8_quantize(x, "tensor", dtype, rowwise=rowwise,
                                       transposed=transposed, scale=s)
    return q, qt, f, f


def _quantize_w(w, recipe: Recipe):
    """w [K, N]: (w rowwise, w^T, factors as B of the forward ([N, K]),
    factors as B of the input gradient ([K, N]))."""
    if recipe.scaling == "block":
        wq, wt, fw, _ = fp8_ops.fp8_quantize(w, "blocks", prim.E4M3, transposed=True)
        return wq, wt, fw, fw.T
    wq, wt, fw, _ = fp8_ops.fp8_quantize(w, "tensor", prim.E4M3, transposed=True,
                                         margin=recipe.margin)
    return wq, wt, fw, fw


def _gemm(a, b, fa, fb, recipe: Recipe, out_dtype, b_row_blocks=False):
    scaling = "block" if recipe.scaling == "block" else "tensor"
    return fp8_ops.fp8_matmul(a, b, fa, fb, scaling=scaling, b_row_blocks=b_row_blocks,
                              out_dtype=_out(out_dtype)).astype(out_dtype)


def _quantize_local(a, recipe: Recipe, dtype, *, rowwise=True, transposed=False):
    """A rank-local operand (no axis-wide scale): (q, qt, factors of q,
    factors of qt)."""
    return _quantize_rows_sharded(a, (), 1, recipe, dtype, rowwise=rowwise,
                                  transposed=transposed)


def _gather_rows(q, qt, fq, fqt, names, n: int, recipe: Recipe):
    """An operand quantized by `_quantize_rows_sharded`, gathered along its
    rows: the row-wise copy (axis 0), the transposed copy (axis 1) and, with
    block factors, their factors ([K/128, rows] along axis 1, [rows/128, K]
    along axis 0); a per-tensor factor is already the axis's."""
    block = recipe.scaling == "block"
    return (_gather(q, names, n), _gather(qt, names, n, axis=1),
            _gather(fq, names, n, axis=1) if block else fq,
            _gather(fqt, names, n, axis=0) if block else fqt)


def _local_forward(x, w, recipe: Recipe, out_dtype):
    """This rank's partial product x @ w [M, N] (x [M, K_local]) and the
    backward's residuals: x^T and w quantized, with their factors."""
    q, qt, fq, fqt = _quantize_local(x, recipe, recipe.fwd_dtype, transposed=True)
    wq, wt, fw_fwd, fw_bwd = _quantize_w(w, recipe)
    partial = _gemm(q, wt, fq, fw_fwd, recipe, out_dtype)
    return partial, (qt, fqt, wq, fw_bwd, fp8_ops.residual_marker(x),
                     fp8_ops.residual_marker(w))


def _grads(quantized_dy, res, recipe: Recipe, reduce_dx=lambda dx: dx):
    """(dx, dw) typed like (x, w): dx = reduce_dx(dy w^T), dw = x^T dy, from
    the quantized dy (q, qt, their factors) and the forward's residuals."""
    dq, dt, fdq, fdt = quantized_dy
    qt, fqt, wq, fw_bwd, xm, wm = res
    dx = reduce_dx(_gemm(dq, wq, fdq, fw_bwd, recipe, xm.dtype))
    dw = _gemm(qt, dt, fqt, fdt, recipe, wm.dtype, b_row_blocks=recipe.scaling == "block")
    return sum_to_type_of(dx, xm), sum_to_type_of(dw, wm)


# ---- all_gather_matmul -------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def all_gather_matmul(x, w, names, n: int, recipe: Recipe, out_dtype):
    """all_gather(x, tiled) @ w with FP8 GEMMs: x [m, K] this rank's rows."""
    return _ag_fwd(x, w, names, n, recipe, out_dtype)[0]


def _ag_fwd(x, w, names, n, recipe, out_dtype):
    q, qt, fq, fqt = _gather_rows(*_quantize_rows_sharded(x, names, n, recipe,
                                                          recipe.fwd_dtype, transposed=True),
                                  names, n, recipe)
    wq, wt, fw_fwd, fw_bwd = _quantize_w(w, recipe)
    y = _gemm(q, wt, fq, fw_fwd, recipe, out_dtype)
    # the weight gradient reads x^T gathered along the tokens
    return y, (qt, fqt, wq, fw_bwd, fp8_ops.residual_marker(x), fp8_ops.residual_marker(w))


def _ag_bwd(names, n, recipe, out_dtype, res, dy):
    # dy [n m, N_local] is local to this rank's column shard; dy w^T [n m, K]
    # is reduce-scattered to this rank's rows
    return _grads(_quantize_local(dy, recipe, recipe.bwd_dtype, transposed=True), res, recipe,
                  lambda dx: _scatter(dx, names, n))


all_gather_matmul.defvjp(_ag_fwd, _ag_bwd)


# ---- matmul_reduce_scatter ---------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def matmul_reduce_scatter(x, w, names, n: int, recipe: Recipe, out_dtype):
    """psum_scatter(x @ w, tiled) with FP8 GEMMs: x [M, K_local]."""
    return _rs_fwd(x, w, names, n, recipe, out_dtype)[0]


def _rs_fwd(x, w, names, n, recipe, out_dtype):
    partial, res = _local_forward(x, w, recipe, out_dtype)
    return _scatter(partial, names, n), res


def _rs_bwd(names, n, recipe, out_dtype, res, dy):
    # dy [M / n, N] this rank's rows: gathered in FP8 (row-wise for dx, the
    # transposed copy along the tokens for dw)
    return _grads(_gather_rows(*_quantize_rows_sharded(dy, names, n, recipe, recipe.bwd_dtype,
                                                        transposed=True), names, n, recipe),
                  res, recipe)


matmul_reduce_scatter.defvjp(_rs_fwd, _rs_bwd)


# ---- matmul_all_reduce -------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def matmul_all_reduce(x, w, names, n: int, recipe: Recipe, out_dtype):
    """psum(x @ w) with an FP8 GEMM: x [M, K_local]; every rank gets the same bits."""
    return _ar_fwd(x, w, names, n, recipe, out_dtype)[0]


def _ar_fwd(x, w, names, n, recipe, out_dtype):
    partial, res = _local_forward(x, w, recipe, out_dtype)
    return all_reduce(partial, names), res  # also at n = 1: psum's invariant result type


def _ar_bwd(names, n, recipe, out_dtype, res, dy):
    """psum's transpose: every rank gets the full (invariant) dy; both
    gradients are local FP8 GEMMs."""
    return _grads(_quantize_local(make_varying(dy, names), recipe, recipe.bwd_dtype,
                                  transposed=True), res, recipe)


matmul_all_reduce.defvjp(_ar_fwd, _ar_bwd)
