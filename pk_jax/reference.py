"""Pure-lax implementations: the CPU path, the fallback, and the test oracle.

Each function has exactly the semantics of the matching pk_jax op.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def all_gather(x: jax.Array, axis_name: str | Sequence[str], *, axis: int = 0,
               tiled: bool = False) -> jax.Array:
    """`lax.all_gather` (XLA's collective; NCCL on GPUs)."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def _dot(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """a[..., K] @ b[K, N] with fp32 accumulation, result in out_dtype."""
    dims = (((a.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str | Sequence[str], *,
                      out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(all_gather(x, axis 0, tiled) @ w, the gathered x)."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
    return _dot(gathered, w, out_dtype or x.dtype), gathered


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str | Sequence[str], *,
                          out_dtype=None) -> jax.Array:
    """psum_scatter(x @ w, scatter_dimension=0, tiled=True)."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    y = _dot(x, w, out_dtype or x.dtype)
    return lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
