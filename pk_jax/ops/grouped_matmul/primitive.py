"""The primitive of pk_jax.grouped_matmul: jax.lax.ragged_dot's forward and
its two gradients as one kernel call each (csrc/kernels/grouped_matmul).

`pk_grouped_matmul(a, b, group_sizes, kind)`, rows grouped consecutively
(group g: rows [o_g, o_g + r_g), r_g = max(group_sizes[g], 0), a group
reaching past row M cut at M):

    forward   a = lhs [M, K], b = rhs [G, K, N]   -> [M, N]: rows of g @ rhs[g]
    lhs_grad  a = dout [M, N], b = rhs [G, K, N]  -> [M, K]: rows of g @ rhs[g]^T
    rhs_grad  a = lhs [M, K], b = dout [M, N]     -> [G, K, N]: lhs_g^T @ dout_g

Rows past the groups' sum (forward, lhs_grad) and the groups with no rows
(rhs_grad) are zeros. One dtype throughout (the forward's result may be
float32: `out_dtype`), fp32 accumulation (float64 for float64 operands, which
only the reference takes). Lowering: on
CUDA with the extension built with CUTLASS, the FFI kernel of
xla_ffi/grouped_matmul.cc (its scratch a second result, dropped); anywhere
else `reference`. Which shapes the kernel takes is decided before binding
(`kernel_problem`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax._compat import result_aval, vary_alike
from pk_jax.ops._lowering import kernels_missing

grouped_matmul_p = Primitive("pk_grouped_matmul")

KINDS = {"forward": 0, "lhs_grad": 1, "rhs_grad": 2}  # grouped_matmul.h: Kind
# Mirrors of csrc/kernels/grouped_matmul/grouped_matmul.h (tests/test_constants_cpu.py).
MAX_GROUPS = 2048
PER_GROUP_SCRATCH = 256
KERNEL_SCRATCH = 1 << 20
_TYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def scratch_bytes(groups: int) -> int:
    """grouped_matmul.h's scratch_bytes."""
    return groups * PER_GROUP_SCRATCH + KERNEL_SCRATCH


def kernel_problem(lhs, rhs) -> str | None:
    """None when the kernel takes lhs [M, K] @ rhs [G, K, N] (and so both
    gradients), else why not."""
    g, k, n = rhs.shape
    if jnp.dtype(lhs.dtype) not in _TYPES or rhs.dtype != lhs.dtype:
        return f"the kernel takes bfloat16 or float16 operands of one dtype, got {lhs.dtype}, " \
               f"{rhs.dtype}"
    if k % 8 or n % 8:
        return f"K={k} and N={n} must be multiples of 8 (16-byte rows)"
    if not 1 <= g <= MAX_GROUPS:
        return f"{g} groups: the kernel takes 1..{MAX_GROUPS}"
    if max(lhs.shape[0], k, n, k * n) >= 1 << 31:
        return "M, K, N and K * N must stay below 2^31"
    return None


def clamped_sizes(group_sizes, rows: int):
    """Each group's rows after the clamps (negative -> 0, cut at row M), as
    int32 (M < 2^31). Clamped in the sizes' own dtype before the cast (an
    int64 size of 2^32 is more than M rows, not 0) and summed saturating at
    M (no int32 overflow however many groups are large)."""
    group_sizes = jnp.asarray(group_sizes)
    top = jnp.iinfo(group_sizes.dtype).max
    s = jnp.clip(group_sizes, 0, rows) if rows <= top else jnp.maximum(group_sizes, 0)
    s = s.astype(jnp.int32)
    ends = lax.associative_scan(lambda a, b: a + jnp.minimum(b, rows - a), s)  # min(sum, M)
    return ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])


def accumulation_dtype(dtype):
    """fp32, or float64 for float64 operands (computed at their precision)."""
    return jnp.promote_types(dtype, jnp.float32)


def reference(a, b, group_sizes, kind: str, out_dtype=None):
    """What the kernel computes, with jax.lax.ragged_dot (any platform)."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    rows = a.shape[0]
    sizes = clamped_sizes(group_sizes, rows)
    used = jnp.arange(rows) < jnp.sum(sizes)

    acc = accumulation_dtype(a.dtype)

    def rows_dot(x, w):
        out = lax.ragged_dot(x, w, sizes, preferred_element_type=acc)
        return jnp.where(used[:, None], out, 0).astype(out_dtype)

    if kind == "forward":
        return rows_dot(a, b)
    if kind == "lhs_grad":
        return rows_dot(a, jnp.swapaxes(b, 1, 2))
    # rhs_grad: [G, K, N], the rows contracted group by group (the ragged
    # dimension contracted). Not a vjp of the forward: inside shard_map that
    # would sum the result over the axes `a` varies over.
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = lax.ragged_dot_general(a, jnp.where(used[:, None], b, 0), sizes, dims,
                                preferred_element_type=acc)
    return dw.astype(a.dtype)


def bind(a, b, group_sizes, kind: str, forced: bool = False, out_dtype=None):
    """One kernel call (see the module docstring); the caller checked
    kernel_problem on the forward's operands. `forced`: where the kernel
    cannot run on CUDA, an error instead of the reference. `out_dtype`:
    a's dtype (None) or float32 (forward only)."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    args = vary_alike(a, b, jnp.asarray(group_sizes, jnp.int32))
    return grouped_matmul_p.bind(*args, kind=kind, forced=bool(forced), out_dtype=out_dtype)


def _out_shape(a, b, groups: int, kind: str):
    if kind == "forward":
        return (a.shape[0], b.shape[2])
    if kind == "lhs_grad":
        return (a.shape[0], b.shape[1])
    return (groups, a.shape[1], b.shape[1])


def _abstract(a, b, group_sizes, *, kind: str, forced: bool, out_dtype):
    return result_aval(a, _out_shape(a, b, group_sizes.shape[0], kind), dtype=out_dtype)


def _reference_lowering(ctx, a, b, group_sizes, *, kind: str, forced: bool = False,
                        out_dtype=None):
    return mlir.lower_fun(lambda a, b, s: reference(a, b, s, kind, out_dtype),
                          multiple_results=False)(ctx, a, b, group_sizes)


def _cuda(ctx, a, b, group_sizes, *, kind: str, forced: bool, out_dtype):
    if kernels_missing("grouped_matmul", need_cutlass=True,  # sets up the runtime
                       forced="kernel" if forced else None):
        return _reference_lowering(ctx, a, b, group_sizes, kind=kind, out_dtype=out_dtype)
    out_aval = ctx.avals_out[0]
    groups = ctx.avals_in[2].shape[0]
    scratch = jax.core.ShapedArray((scratch_bytes(groups),), jnp.uint8)
    inner = ctx.replace(avals_out=[out_aval, scratch])
    out, _ = jax.ffi.ffi_lowering("pk_grouped_matmul")(
        inner, a, b, group_sizes, kind=np.int32(KINDS[kind]))
    return [out]


@functools.cache
def _jitted(kind: str, forced: bool, out_dtype):
    return jax.jit(functools.partial(grouped_matmul_p.bind, kind=kind, forced=forced,
                                     out_dtype=out_dtype))


grouped_matmul_p.def_impl(  # eager calls
    lambda a, b, s, *, kind, forced, out_dtype: _jitted(kind, forced, out_dtype)(a, b, s))
grouped_matmul_p.def_abstract_eval(_abstract)
mlir.register_lowering(grouped_matmul_p, _reference_lowering)
mlir.register_lowering(grouped_matmul_p, _cuda, platform="cuda")
