"""`zigzag_shard` / `zigzag_unshard`: reorder a global sequence so that
contiguous sharding over n ranks gives rank r the zigzag chunks r and
2n - 1 - r (ring attention's balanced causal layout), and back.

An array whose type shards the sequence over mesh axes of size n (explicit
sharding) is reordered where it lies: every device sends its two chunks to
their new owners with two collective permutes, and the result keeps the
input's sharding. Other arrays are reordered by a reshape (under jit on Auto
meshes XLA moves the data).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from pk_jax import _args
from pk_jax._explicit import explicit_mesh, reshard, type_sharding


def _check(x: jax.Array, axis_size: int, seq_axis: int, op: str) -> int:
    """The normalized seq_axis, after checking the arguments."""
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) \
            or axis_size < 1:
        raise ValueError(f"pk_jax.{op}: axis_size must be a positive int, got {axis_size!r}")
    dim = _args.axis(op, "seq_axis", seq_axis, x.ndim, f"a rank-{x.ndim} array")
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
    if (sharded := _sharded_seq(x, dim)) is not None:
        return _permute(x, dim, axis_size, *sharded, inverse=False)
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
    if (sharded := _sharded_seq(x, dim)) is not None:
        return _permute(x, dim, axis_size, *sharded, inverse=True)
    n, shape = axis_size, x.shape
    pairs = x.reshape(shape[:dim] + (n, 2, shape[dim] // (2 * n)) + shape[dim + 1:])
    first, second = jnp.take(pairs, 0, axis=dim + 1), jnp.take(pairs, 1, axis=dim + 1)
    return jnp.stack([first, jnp.flip(second, dim)], dim).reshape(shape)


def _sharded_seq(x: jax.Array, dim: int):
    """(mesh, spec, axes) when `x`'s type shards dim `dim` over Explicit mesh
    axes, else None."""
    mesh = explicit_mesh(x)
    if mesh is None:
        return None
    spec = tuple(type_sharding(x).spec) + (None,) * x.ndim
    entry = spec[dim]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return (mesh, P(*spec[:x.ndim]), axes) if axes else None


def _permute(x, dim: int, n: int, mesh, spec: P, axes: tuple, inverse: bool):
    """The zigzag reorder (or its inverse) of `x`, whose dim `dim` is sharded
    over `axes`; the result has `x`'s sharding.

    Natural order: device t holds chunks 2t, 2t + 1 (of 2n). Zigzag: device t
    holds chunks t, 2n - 1 - t. Chunk j's zigzag owner is j for j < n, else
    2n - 1 - j; the even chunks of the natural order move with one
    collective permute and the odd ones with another (each a bijection:
    every device receives one even and one odd chunk).
    """
    if int(np.prod([mesh.shape[a] for a in axes])) != n:
        # The sequence is sharded over another number of devices: reorder it
        # unsharded, then shard it again as it was.
        full = list(spec)
        full[dim] = None
        fn = zigzag_unshard if inverse else zigzag_shard
        return reshard(fn(reshard(x, mesh, P(*full)), n, dim), mesh, spec)
    owner = lambda j: j if j < n else 2 * n - 1 - j
    even = [(t, owner(2 * t)) for t in range(n)]      # natural device -> zigzag device
    odd = [(t, owner(2 * t + 1)) for t in range(n)]
    if inverse:
        even, odd = [(b, a) for a, b in even], [(b, a) for a, b in odd]

    def local(block):
        c = block.shape[dim] // 2
        first, second = lax.slice_in_dim(block, 0, c, axis=dim), lax.slice_in_dim(
            block, c, 2 * c, axis=dim)
        t = lax.axis_index(axes)
        if inverse:  # zigzag device t: chunk t (slot 0) has t's parity
            t_even = t % 2 == 0
            mine_even = jnp.where(t_even, first, second)
            mine_odd = jnp.where(t_even, second, first)
            got_even = lax.ppermute(mine_even, axes, even)
            got_odd = lax.ppermute(mine_odd, axes, odd)
            return jnp.concatenate([got_even, got_odd], axis=dim)  # chunks 2t, 2t + 1
        got_even = lax.ppermute(first, axes, even)   # chunk 2t goes out
        got_odd = lax.ppermute(second, axes, odd)    # chunk 2t + 1 goes out
        t_even = t % 2 == 0  # zigzag slot 0 is chunk t: even when t is
        return jnp.concatenate([jnp.where(t_even, got_even, got_odd),
                                jnp.where(t_even, got_odd, got_even)], axis=dim)

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x)
