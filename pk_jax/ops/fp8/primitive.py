"""The primitives of pk_jax's FP8 op (internal; the public functions are in
pk_jax/ops/fp8/api.py): quantization and the scaled FP8 GEMM, each one kernel
call on CUDA (csrc/kernels/fp8, csrc/kernels/gemm) and its reference (the same
numerics in jax.numpy) everywhere else.

`pk_fp8_quantize(x [R, C], scale [1])` -> (q [R, C] or [0, 0], qt [C, R] or
[0, 0], factors, factors_t, amax [1] or [0]); granularity
(csrc/kernels/fp8/fp8.h):

    tensor  one factor ([1]); the scale is fp8_max * 2^-margin / amax(x)
            (current scaling) or the `scale` operand (given_scale: delayed
            scaling); amax = amax(x)
    rows    a factor per 1x128 along C: factors [ceil(C / 128), R]; with
            row_groups = g the rows in g groups of R / g consecutive rows,
            each group's [ceil(C / 128), R / g] in turn: [g * ceil(C / 128),
            R / g] (`group_rows`; g = 1: the plain layout)
    cols    a factor per 128x1 along R, transposed copy only: [ceil(R / 128), C]
    blocks  a factor per 128x128 block: [ceil(R / 128), ceil(C / 128)]
    rows_cols    both copies in one pass: q per 1x128 ("rows", factors) and
                 qt per 128x1 ("cols", factors_t)
    rows_blocks  q per 1x128 ("rows", factors) and qt per 128x128 ("blocks",
                 factors_t)
factors_t is [0] but for the two last (TWO_FACTORS).

A block's scale is fp8_max / amax (1 when amax is 0; at most MAX_SCALE = 2^126,
so a block of vanishing values never turns NaN), its factor 1 / scale;
values are x * scale in float32, clipped to +-fp8_max and rounded to nearest
even (NaN stays NaN).

`pk_fp8_matmul(a [M, K], b [N, K], scale_a, scale_b)` -> out [M, N]: a @ b^T
with the factors (scaling "tensor": one each; "block": a's [ceil(K / 128), M]
per 1x128, b's [ceil(K / 128), ceil(N / 128)] per 128x128, or with
b_row_blocks [ceil(K / 128), N] per 1x128), fp32 accumulation, bf16 or fp32
out; attribute `library` (gemm.h: Library): who runs the GEMM,
pk's CUTLASS kernel or cuBLASLt (`gemm_attributes`, tuning.fp8_gemm_library);
parameter `fast_accum`: per-tensor products with an e5m2 operand skip the
fp32 promotion where cuBLASLt runs them (e4m3 x e4m3 always does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from pk_jax import runtime, tuning
from pk_jax._compat import result_aval, vary_alike
from pk_jax.ops._lowering import def_eager_impl, kernels_missing

quantize_p = Primitive("pk_fp8_quantize")
quantize_p.multiple_results = True
matmul_p = Primitive("pk_fp8_matmul")

# Mirrors of csrc/kernels/fp8/fp8.h (Granularity, kBlock) and
# csrc/kernels/gemm/gemm.h (Scaling) (tests/test_constants_cpu.py).
GRANULARITY = {"tensor": 0, "rows": 1, "cols": 2, "blocks": 3, "rows_cols": 4, "rows_blocks": 5}
# Granularities of both copies with a layout each: (q's, qt's) (fp8.h).
TWO_FACTORS = {"rows_cols": ("rows", "cols"), "rows_blocks": ("rows", "blocks")}
SCALING = {"none": 0, "tensor": 1, "block": 2}  # "none": the bf16/fp16 GEMMs
LIBRARY = {"cutlass": 0, "cublaslt": 1}  # gemm.h: Library (tuning.fp8_gemm_library)
BLOCK = 128
# The largest scale (quantize.cu: kMaxScale): 2^126, its factor float32's
# smallest normal.
MAX_SCALE = 2.0 ** 126

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_TYPES = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
IN_TYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
OUT_TYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def blocks(extent: int) -> int:
    return -(-extent // BLOCK)


def q_granularity(granularity: str) -> str:
    """The one-layout granularity of `factors`: q's for TWO_FACTORS."""
    return TWO_FACTORS[granularity][0] if granularity in TWO_FACTORS else granularity


def factors_shape(granularity: str, rows: int, cols: int, row_groups: int = 1
                  ) -> tuple[int, ...]:
    """The shape of `factors` (q's factors for TWO_FACTORS)."""
    granularity = q_granularity(granularity)
    return {"tensor": (1,), "rows": (row_groups * blocks(cols), rows // row_groups),
            "cols": (blocks(rows), cols), "blocks": (blocks(rows), blocks(cols))}[granularity]


def factors_t_shape(granularity: str, rows: int, cols: int) -> tuple[int, ...]:
    """The shape of `factors_t`: qt's factors for TWO_FACTORS, else (0,)."""
    if granularity not in TWO_FACTORS:
        return (0,)
    return factors_shape(TWO_FACTORS[granularity][1], rows, cols)


def group_rows(factors, groups: int):
    """Row factors [Kb, R] (per 1x128) in `groups` row groups: [groups * Kb,
    R / groups], group g's [Kb, R / groups] (the factors of its rows) at rows
    g * Kb.. (csrc/kernels/fp8/fp8.h: kRows' row groups)."""
    kb, r = factors.shape
    return factors.reshape(kb, groups, r // groups).transpose(1, 0, 2).reshape(
        groups * kb, r // groups)


def ungroup_rows(factors, groups: int):
    """`group_rows`' inverse: [groups * Kb, R / groups] -> [Kb, R]."""
    gkb, gr = factors.shape
    return factors.reshape(groups, gkb // groups, gr).transpose(1, 0, 2).reshape(
        gkb // groups, groups * gr)


# --- reference numerics (what the kernels compute) --------------------------

def _scale_of(amax, fp8_max):
    """fp8_max / amax, 1 where amax is 0, at most MAX_SCALE (a vanishing amax
    would give an infinite scale, and 0 * inf = NaN); NaN stays NaN
    (float32)."""
    amax = amax.astype(jnp.float32)
    scale = jnp.minimum(jnp.float32(fp8_max) / amax, jnp.float32(MAX_SCALE))
    return jnp.where(amax == 0, jnp.float32(1), scale)


def _convert(v, dtype):
    """float32 -> FP8, saturating at the largest finite value (NaN stays)."""
    m = FP8_MAX[jnp.dtype(dtype)]
    return jnp.clip(v, -m, m).astype(dtype)


def _blocked_amax(xf, granularity: str):
    """amax per block of the granularity, with the factors' layout."""
    r, c = xf.shape
    a = jnp.abs(xf)
    pad_r = blocks(r) * BLOCK - r if granularity in ("cols", "blocks") else 0
    pad_c = blocks(c) * BLOCK - c if granularity in ("rows", "blocks") else 0
    a = jnp.pad(a, ((0, pad_r), (0, pad_c)))
    if granularity == "rows":   # [R, Cb, 128] -> [Cb, R]
        return jnp.max(a.reshape(r, -1, BLOCK), axis=2).T
    if granularity == "cols":   # [Rb, 128, C] -> [Rb, C]
        return jnp.max(a.reshape(-1, BLOCK, c), axis=1)
    return jnp.max(a.reshape(a.shape[0] // BLOCK, BLOCK, a.shape[1] // BLOCK, BLOCK), axis=(1, 3))


def _expand(per_block, granularity: str, rows: int, cols: int):
    """A per-block array back to [rows, cols] (inverse of _blocked_amax's layout)."""
    if granularity == "rows":
        return jnp.repeat(per_block.T, BLOCK, axis=1)[:, :cols]
    if granularity == "cols":
        return jnp.repeat(per_block, BLOCK, axis=0)[:rows]
    return jnp.repeat(jnp.repeat(per_block, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]


def quantize_reference(x, scale, *, granularity: str, dtype, rowwise: bool, transposed: bool,
                       given_scale: bool, margin: float, row_groups: int = 1):
    """What pk_fp8_quantize computes (any platform)."""
    no_factors = jnp.zeros((0,), jnp.float32)
    if granularity in TWO_FACTORS:  # each copy as its own granularity gives it
        of_q, of_qt = TWO_FACTORS[granularity]
        q, _, factors, _, amax = quantize_reference(
            x, scale, granularity=of_q, dtype=dtype, rowwise=True, transposed=False,
            given_scale=False, margin=0.0, row_groups=row_groups)
        _, qt, factors_t, _, _ = quantize_reference(
            x, scale, granularity=of_qt, dtype=dtype, rowwise=False, transposed=True,
            given_scale=False, margin=0.0)
        return q, qt, factors, factors_t, amax
    dtype = jnp.dtype(dtype)
    fp8_max = FP8_MAX[dtype]
    xf = x.astype(jnp.float32)
    r, c = x.shape
    empty = jnp.zeros((0, 0), dtype)
    if granularity == "tensor":
        amax = jnp.max(jnp.abs(xf)).reshape(1)
        s = scale.astype(jnp.float32).reshape(()) if given_scale else \
            _scale_of(amax[0], fp8_max * 2.0 ** -margin)
        factors = (jnp.float32(1) / s).reshape(1)
        full = s
    else:
        per_block = _scale_of(_blocked_amax(xf, granularity), fp8_max)
        factors = jnp.float32(1) / per_block
        if row_groups > 1:
            factors = group_rows(factors, row_groups)
        full = _expand(per_block, granularity, r, c)
        amax = jnp.zeros((0,), jnp.float32)
    q = _convert(xf * full, dtype)
    return (q if rowwise else empty, q.T if transposed else empty, factors, no_factors, amax)


def dequantize(q, factors, scaling: str, *, row_blocks: bool = True):
    """float32 values of an FP8 GEMM operand [rows, K] with its factors
    (scaling "tensor": one; "block": per 1x128 [Kb, rows], or per 128x128
    [Kb, ceil(rows / 128)] when not row_blocks)."""
    qf = q.astype(jnp.float32)
    if scaling == "tensor":
        return qf * factors.reshape(())
    rows, k = q.shape
    f = factors.T  # [rows or rows blocks, Kb]
    if not row_blocks:
        f = jnp.repeat(f, BLOCK, axis=0)[:rows]
    return qf * jnp.repeat(f, BLOCK, axis=1)[:, :k]


def matmul_reference(a, b, scale_a, scale_b, *, scaling: str, b_row_blocks: bool, out_dtype,
                     fast_accum: bool = False):
    """What pk_fp8_matmul computes: dequantized operands, fp32 products (the
    kernels' fast accumulation, where asked for, within rounding of them)."""
    if scaling == "tensor":
        acc = lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                              (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
        out = acc * (scale_a.reshape(()) * scale_b.reshape(()))
    else:
        out = lax.dot_general(dequantize(a, scale_a, scaling),
                              dequantize(b, scale_b, scaling, row_blocks=b_row_blocks),
                              (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype)


# --- binding ----------------------------------------------------------------

def quantize(x, *, granularity: str, dtype, rowwise: bool, transposed: bool, scale=None,
             margin: float = 0.0, row_groups: int = 1):
    """(q, qt, factors, factors_t, amax) of x [R, C] (the module docstring);
    the caller validated the arguments."""
    given = scale is not None
    s = jnp.asarray(scale if given else 1.0, jnp.float32).reshape(1)
    x, s = vary_alike(x, s)
    return quantize_p.bind(x, s, granularity=granularity, dtype=jnp.dtype(dtype),
                           rowwise=bool(rowwise), transposed=bool(transposed),
                           given_scale=given, margin=float(margin),
                           row_groups=int(row_groups))


def matmul(a, b, scale_a, scale_b, *, scaling: str, b_row_blocks: bool = False, out_dtype,
           fast_accum: bool = False):
    """a [M, K] @ b [N, K]^T with the factors; the caller validated."""
    args = vary_alike(a, b, scale_a.astype(jnp.float32), scale_b.astype(jnp.float32))
    return matmul_p.bind(*args, scaling=scaling, b_row_blocks=bool(b_row_blocks),
                         out_dtype=jnp.dtype(out_dtype), fast_accum=bool(fast_accum))


def unsharded(a):
    """`a` replicated where its type is sharded over Explicit mesh axes
    (plain jit on such arrays): these ops have no partitioning rule, so a
    call outside shard_map gathers its operands (inside shard_map, and on
    Auto meshes, `a` as is)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and any(p is not None for p in spec):
        return jax.sharding.reshard(a, jax.sharding.NamedSharding(sharding.mesh, P()))
    return a


def _quantize_abstract(x, s, *, granularity, dtype, rowwise, transposed, given_scale, margin,
                       row_groups):
    r, c = x.shape
    fp8 = lambda shape: result_aval(x, shape, dtype)
    f32 = lambda shape: result_aval(x, shape, jnp.dtype(jnp.float32))
    return [fp8((r, c) if rowwise else (0, 0)), fp8((c, r) if transposed else (0, 0)),
            f32(factors_shape(granularity, r, c, row_groups)),
            f32(factors_t_shape(granularity, r, c)),
            f32((1,) if granularity == "tensor" else (0,))]


def _matmul_abstract(a, b, sa, sb, *, scaling, b_row_blocks, out_dtype, fast_accum):
    return result_aval(a, (a.shape[0], b.shape[0]), out_dtype)


def _quantize_reference_lowering(ctx, x, s, **params):
    return mlir.lower_fun(lambda x, s: quantize_reference(x, s, **params),
                          multiple_results=True)(ctx, x, s)


def _matmul_reference_lowering(ctx, a, b, sa, sb, **params):
    return mlir.lower_fun(lambda *args: matmul_reference(*args, **params),
                          multiple_results=False)(ctx, a, b, sa, sb)


def _quantize_cuda(ctx, x, s, **params):
    if kernels_missing("fp8_quantize"):
        return _quantize_reference_lowering(ctx, x, s, **params)
    return jax.ffi.ffi_lowering("pk_fp8_quantize")(
        ctx, x, s, granularity=np.int32(GRANULARITY[params["granularity"]]),
        given_scale=params["given_scale"], margin=np.float32(params["margin"]),
        row_groups=np.int32(params["row_groups"]))


def gemm_attributes(scaling: str, fast_accum: bool) -> dict:
    """The FFI attributes of an FP8 GEMM lowered now (pk_fp8_matmul's and the
    TP *_fp8 targets'): `scaling` (gemm.h: Scaling), `library` (gemm.h:
    Library; tuning.fp8_gemm_library, the kernels are ready) and
    `fast_accum` (gemm::Problem::fast_accum)."""
    loaded = runtime.extension().cublaslt_version() > 0
    return dict(scaling=np.int32(SCALING[scaling]),
                library=np.int32(LIBRARY[tuning.fp8_gemm_library(scaling, loaded)]),
                fast_accum=bool(fast_accum))


def _matmul_cuda(ctx, a, b, sa, sb, *, scaling, b_row_blocks, out_dtype, fast_accum):
    if kernels_missing("fp8_matmul", need_cutlass=True):
        return _matmul_reference_lowering(ctx, a, b, sa, sb, scaling=scaling,
                                          b_row_blocks=b_row_blocks, out_dtype=out_dtype)
    return jax.ffi.ffi_lowering("pk_fp8_matmul")(
        ctx, a, b, sa, sb, b_row_blocks=b_row_blocks, **gemm_attributes(scaling, fast_accum))


def_eager_impl(quantize_p)
quantize_p.def_abstract_eval(_quantize_abstract)
mlir.register_lowering(quantize_p, _quantize_reference_lowering)
mlir.register_lowering(quantize_p, _quantize_cuda, platform="cuda")
def_eager_impl(matmul_p)
matmul_p.def_abstract_eval(_matmul_abstract)
mlir.register_lowering(matmul_p, _matmul_reference_lowering)
mlir.register_lowering(matmul_p, _matmul_cuda, platform="cuda")
