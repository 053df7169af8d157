"""`zigzag_shard` / `zigzag_unshard`: reorder a global sequence so that
contiguous sharding over n ranks gives rank r the zigzag chunks r and
2n - 1 - r (ring attention's balanced causal layout), and back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _check(x: jax.Array, axis_size: int, seq_axis: int, op: str) -> int:
    """The normalized seq_axis, after checking the arguments."""
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) \
            or axis_size < 1:
        raise ValueError(f"pk_jax.{op}: axis_size must be a positive int, got {axis_size!r}")
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(f"pk_jax.{op}: seq_axis={seq_axis} out of range for a rank-{x.ndim} "
                         f"array (valid: {-x.ndim}..{x.ndim - 1})")
    dim = seq_axis % x.ndim
    if x.shape[dim] % (2 * axis_size):
        raise ValueError(f"pk_jax.{op}: the sequence length ({x.shape[dim]}, axis {dim}) "
                         f"must divide by 2 * axis_size ({2 * axis_size})")
    return dim


def zigzag_shard(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Reorder a global array so that contiguous sharding of `seq_axis` over
    `axis_size` ranks gives rank r the zigzag chunks r and 2n - 1 - r.

    Args:
      x: the global array (q, k, v, positions, labels, ...), any rank.
      axis_size: n, the size of the mesh axis the sequence is sharded over.
      seq_axis: the sequence axis; its length must divide by 2n.

    Returns:
      x with its 2n sequence chunks in the order 0, 2n-1, 1, 2n-2, ...
    """
    x = jnp.asarray(x)
    dim = _check(x, axis_size, seq_axis, "zigzag_shard")
    n, shape = axis_size, x.shape
    # [..., L, ...] -> [..., 2 (halves), n, c, ...]; rank r takes chunk r of the
    # first half and chunk n - 1 - r of the second (= chunk 2n - 1 - r).
    halves = x.reshape(shape[:dim] + (2, n, shape[dim] // (2 * n)) + shape[dim + 1:])
    first, second = jnp.take(halves, 0, axis=dim), jnp.take(halves, 1, axis=dim)
    return jnp.stack([first, jnp.flip(second, dim)], dim + 1).reshape(shape)


def zigzag_unshard(x: jax.Array, axis_size: int, seq_axis: int = 1) -> jax.Array:
    """Inverse of `zigzag_shard`: back to the natural token order.

    Args:
      x: a global array in zigzag order (e.g. the gathered ring_attention
        output of layout="zigzag").
      axis_size: n, the size of the mesh axis.
      seq_axis: the sequence axis; its length must divide by 2n.

    Returns:
      x with its sequence in natural order.
    """
    x = jnp.asarray(x)
    dim = _check(x, axis_size, seq_axis, "zigzag_unshard")
    n, shape = axis_size, x.shape
    pairs = x.reshape(shape[:dim] + (n, 2, shape[dim] // (2 * n)) + shape[dim + 1:])
    first, second = jnp.take(pairs, 0, axis=dim + 1), jnp.take(pairs, 1, axis=dim + 1)
    return jnp.stack([first, jnp.flip(second, dim)], dim).reshape(shape)
