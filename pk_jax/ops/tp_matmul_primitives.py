"""Primitives of the tensor-parallel matmuls, on 2-D operands.

`pk_all_gather_matmul`:     x [m, K], w [K, N] -> (all_gather(x) @ w [n*m, N],
                                                   all_gather(x) [n*m, K] or [0, K])
`pk_matmul_reduce_scatter`: x [M, K], w [K, N] -> psum_scatter(x @ w) [M/n, N]

With `transpose_w=True`, w is given as [N, K] and the product is x @ w^T: the
backward passes multiply by the forward's weight transposed, and the kernels
read it in place (a K-major B operand) instead of XLA materializing w^T.

Lowering: on CUDA with the extension built with CUTLASS, the FFI kernels of
xla_ffi/tp_matmul.cc; anywhere else the reference in pk_jax/reference.py.
Differentiation lives one level up (pk_jax/ops/tp_matmul.py, custom_vjp).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax import reference, runtime
from pk_jax.ops._lowering import channel_attrs, group_table, kernels_missing

all_gather_matmul_p = Primitive("pk_all_gather_matmul")
all_gather_matmul_p.multiple_results = True
matmul_reduce_scatter_p = Primitive("pk_matmul_reduce_scatter")


def _n_cols(w, transpose_w: bool) -> int:
    return w.shape[0] if transpose_w else w.shape[1]


# ---- abstract evaluation ------------------------------------------------------
def _ag_abstract(x, w, *, names, n, out_dtype, return_gathered, mechanism, transpose_w):
    m, k = x.shape
    rows = n * m if return_gathered else 0
    return (x.update(shape=(n * m, _n_cols(w, transpose_w)), dtype=out_dtype),
            x.update(shape=(rows, k)))


def _rs_abstract(x, w, *, names, n, out_dtype, mechanism, transpose_w):
    return x.update(shape=(x.shape[0] // n, _n_cols(w, transpose_w)), dtype=out_dtype)


# ---- reference lowering (every platform but CUDA, and the fallback) ---------
def _ag_reference(ctx, x, w, *, names, n, out_dtype, return_gathered, mechanism, transpose_w):
    def fn(a, b):
        b = b.T if transpose_w else b
        out, gathered = reference.all_gather_matmul(a, b, names, out_dtype=out_dtype)
        return out, gathered if return_gathered else gathered[:0]
    return mlir.lower_fun(fn, multiple_results=True)(ctx, x, w)


def _rs_reference(ctx, x, w, *, names, n, out_dtype, mechanism, transpose_w):
    def fn(a, b):
        b = b.T if transpose_w else b
        return reference.matmul_reduce_scatter(a, b, names, out_dtype=out_dtype)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, w)


# ---- CUDA lowering -----------------------------------------------------------
# The fused matmul_reduce_scatter's output tile (rows, columns): kFusedTileM/N in
# csrc/kernels/tp_matmul/tp_matmul.h (tests/test_build_cpu.py checks they agree).
FUSED_TILE = (128, 256)


def _region_bytes(n: int, rows: int, cols: int, dtype) -> int:
    return n * rows * cols * np.dtype(dtype).itemsize if n > 1 else 0


def _ag_cuda(ctx, x, w, *, names, n, out_dtype, return_gathered, mechanism, transpose_w):
    if mechanism == "xla" or kernels_missing("all_gather_matmul", need_gemm=True):
        return _ag_reference(ctx, x, w, names=names, n=n, out_dtype=out_dtype,
                             return_gathered=return_gathered, mechanism=mechanism,
                             transpose_w=transpose_w)
    x_aval, _ = ctx.avals_in
    m, k = x_aval.shape
    _, table = group_table(ctx, "all_gather_matmul", names, n)
    ch = runtime.channel(("all_gather_matmul", table.tobytes()),
                         _region_bytes(n, m, k, x_aval.dtype))
    return jax.ffi.ffi_lowering("pk_all_gather_matmul")(
        ctx, x, w, return_gathered=bool(return_gathered), w_transposed=bool(transpose_w),
        **channel_attrs(table, ch))


def _fused_rs_region_bytes(n: int, rows: int, cols: int, dtype) -> int:
    """n slots (256-byte aligned), then the per-tile flags: n senders x tiles
    x 8 bytes (tp_matmul.h, fused_rs_region_bytes)."""
    slots = -(-_region_bytes(n, rows, cols, dtype) // 256) * 256
    tiles = rows // FUSED_TILE[0] * -(-cols // FUSED_TILE[1])
    return slots + n * tiles * 8 if n > 1 else 0


def _rs_cuda(ctx, x, w, *, names, n, out_dtype, mechanism, transpose_w):
    if mechanism == "xla" or kernels_missing("matmul_reduce_scatter", need_gemm=True):
        return _rs_reference(ctx, x, w, names=names, n=n, out_dtype=out_dtype,
                             mechanism=mechanism, transpose_w=transpose_w)
    x_aval, w_aval = ctx.avals_in
    _, table = group_table(ctx, "matmul_reduce_scatter", names, n)
    fused = mechanism == "fused" and n > 1
    region = _fused_rs_region_bytes if fused else _region_bytes
    ch = runtime.channel(("matmul_reduce_scatter", mechanism, table.tobytes()),
                         region(n, x_aval.shape[0] // n, _n_cols(w_aval, transpose_w), out_dtype))
    return jax.ffi.ffi_lowering("pk_matmul_reduce_scatter")(
        ctx, x, w, w_transposed=bool(transpose_w), fused=fused, **channel_attrs(table, ch))


all_gather_matmul_p.def_abstract_eval(_ag_abstract)
mlir.register_lowering(all_gather_matmul_p, _ag_reference)
mlir.register_lowering(all_gather_matmul_p, _ag_cuda, platform="cuda")
matmul_reduce_scatter_p.def_abstract_eval(_rs_abstract)
mlir.register_lowering(matmul_reduce_scatter_p, _rs_reference)
mlir.register_lowering(matmul_reduce_scatter_p, _rs_cuda, platform="cuda")
