"""pk_jax.grouped_matmul: jax.lax.ragged_dot as one grouped-GEMM kernel call,
with both gradients as kernel calls too (the MoE experts' GEMM).

    out = pk_jax.grouped_matmul(rows, w, group_sizes)   # rows [M, K], w [G, K, N]

A local op: call it on a device's own arrays (inside jax.shard_map, e.g. on
the rows pk_jax.moe_dispatch grouped by local expert, or on one device).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _args
from pk_jax.ops.grouped_matmul import primitive as prim

MECHANISMS = ("auto", "kernel", "xla")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type=None, mechanism: str = "auto") -> jax.Array:
    """Rows grouped consecutively, each group times its own matrix.

    Args:
      lhs: [M, K]; rows [o_g, o_g + group_sizes[g]) belong to group g (o_g:
        the sizes before g).
      rhs: [G, K, N], lhs's dtype.
      group_sizes: [G] integers of any integer dtype, on the device (no
        host sync). A negative size counts as 0; a group reaching past row M
        is cut at M (also a 64-bit size of 2^32 or more: nothing wraps).
      preferred_element_type: None (lhs's dtype) or float32: the result's
        dtype.
      mechanism: "kernel" (pk's grouped GEMM: bfloat16 or float16, K and N
        multiples of 8, 1 <= G <= 2048; a ValueError saying why otherwise),
        "xla" (`jax.lax.ragged_dot`), or "auto" (the kernel where it takes
        the shapes, else XLA).

    Returns:
      [M, N] in `preferred_element_type` (fp32 accumulation; float64 operands,
      which take the XLA path, accumulate in float64): row i of group g is
      lhs[i] @ rhs[g]; rows past the groups' sum are zeros. Differentiable
      in lhs and rhs (each gradient one kernel call).
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.grouped_matmul: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"pk_jax.grouped_matmul: expected lhs [M, K] and rhs [G, K, N], got "
                         f"{lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                   jnp.integer):
        raise ValueError(f"pk_jax.grouped_matmul: group_sizes must be [G={rhs.shape[0]}] "
                         f"integers, got {group_sizes.shape} {group_sizes.dtype}")
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"pk_jax.grouped_matmul: lhs and rhs must share one floating dtype, "
                         f"got {lhs.dtype} and {rhs.dtype}")
    out_dtype = (lhs.dtype if preferred_element_type is None else
                 _args.dtype("grouped_matmul", "preferred_element_type", preferred_element_type))
    if out_dtype not in (lhs.dtype, jnp.dtype(jnp.float32)):
        raise ValueError(f"pk_jax.grouped_matmul: preferred_element_type must be None, "
                         f"{lhs.dtype} or float32, got {out_dtype}")
    if lhs.shape[0] > _args.INT32_MAX:
        raise ValueError(f"pk_jax.grouped_matmul: lhs has {lhs.shape[0]} rows; group sizes "
                         "and row indices are int32, so at most 2^31 - 1")
    why = prim.kernel_problem(lhs, rhs) if mechanism != "xla" else "mechanism='xla'"
    if mechanism == "kernel" and why:
        raise ValueError(f"pk_jax.grouped_matmul: mechanism='kernel' cannot run: {why}")
    if why:
        return prim.reference(lhs, rhs, group_sizes, "forward", out_dtype)
    sizes = prim.clamped_sizes(group_sizes, lhs.shape[0])  # int32 without wrapping
    return _kernel(lhs, rhs, sizes, mechanism == "kernel", out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel(lhs, rhs, group_sizes, forced, out_dtype):
    return prim.bind(lhs, rhs, group_sizes, "forward", forced, out_dtype)


def _kernel_fwd(lhs, rhs, group_sizes, forced, out_dtype):
    out = prim.bind(lhs, rhs, group_sizes, "forward", forced, out_dtype)
    return out, (lhs, rhs, group_sizes)


def _kernel_bwd(forced, out_dtype, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = prim.bind(dout, rhs, group_sizes, "lhs_grad", forced)
    drhs = prim.bind(lhs, dout, group_sizes, "rhs_grad", forced)
    zero_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return dlhs, drhs, zero_sizes


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
