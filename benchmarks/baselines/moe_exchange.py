"""MoE token exchanges as a JAX user writes them without pk_jax, each a pair

    rows, group_sizes, state = dispatch(tokens [T, H], ids [T, k], axis, num_experts)
    out [T, H] = combine(y [rows, H'], weights [T, k], state)

with `rows` grouped by local expert (`group_sizes` rows each, the
`jax.lax.ragged_dot` layout), called inside `jax.shard_map` over the expert
axis `axis` (device r holds experts [r * E / n, (r + 1) * E / n)):

  * sort_gather (one device: the axis must have size 1): sort the T * k
    slots by expert (`argsort` of the flattened ids), gather `x[order // k]`;
    combine either scatters back with a weighted sum (`.at[token].add`,
    `combine_scatter_add`) or undoes the sort with the inverse permutation
    and sums each token's k rows (`combine_unsort`);
  * a2a_capacity (across devices, what MaxText-style code does): sort the
    slots by expert, place each in its expert's `capacity` rows ([E,
    capacity, H], a slot past the capacity dropped), one `lax.all_to_all`
    of the per-rank blocks; the rows of a local expert are the n sources'
    capacity blocks, padding included (group sizes n * capacity), and the
    way back is the transposed all_to_all. Drop-less where the capacity is
    at least the largest number of slots one rank sends one expert
    (benchmarks/moe.py sets it so).

The ragged_all_to_all baseline is examples/moe.py's `xla_ragged_dispatch` /
`xla_ragged_combine`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _sorted_slots(ids: jax.Array, num_experts: int):
    """(order: the slots sorted by expert, stably; each sorted slot's expert;
    the slots of each expert [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, flat[order], counts


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse permutation (a scatter, no second sort)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _weighted_sum(slots: jax.Array, weights: jax.Array) -> jax.Array:
    """[T * k, H] rows in slot order -> [T, H]: each token's k rows weighted
    (fp32 accumulation), in the rows' dtype."""
    t, k = weights.shape
    out = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32),
                     slots.reshape(t, k, -1).astype(jnp.float32))
    return out.astype(slots.dtype)


def sort_gather_dispatch(tokens: jax.Array, ids: jax.Array, axis: str, num_experts: int):
    """One device: rows [T * k, H] sorted by expert, their group sizes, and
    the sort order (the state)."""
    if lax.axis_size(axis) != 1:
        raise ValueError("sort_gather is the one-device baseline: the axis must have size 1")
    order, _, counts = _sorted_slots(ids, num_experts)
    return tokens[order // ids.shape[1]], counts, order


def combine_scatter_add(y: jax.Array, weights: jax.Array, order: jax.Array) -> jax.Array:
    """Row i (slot order[i]) added into its token, weighted (fp32)."""
    t, k = weights.shape
    w = weights.reshape(-1)[order].astype(jnp.float32)
    out = jnp.zeros((t, y.shape[1]), jnp.float32).at[order // k].add(
        y.astype(jnp.float32) * w[:, None])
    return out.astype(y.dtype)


def combine_unsort(y: jax.Array, weights: jax.Array, order: jax.Array) -> jax.Array:
    """The rows back in slot order (the inverse permutation, a gather), then
    each token's k rows weighted and summed."""
    return _weighted_sum(y[_inverse(order)], weights)


def a2a_capacity_dispatch(tokens: jax.Array, ids: jax.Array, axis: str, num_experts: int, *,
                          capacity: int):
    """Rows [E / n * n * capacity, H]: local expert l's rows are the n
    sources' blocks of `capacity` rows (zeros past each source's slots)."""
    n = lax.axis_size(axis)
    el, h = num_experts // n, tokens.shape[1]
    order, expert, counts = _sorted_slots(ids, num_experts)
    rank = jnp.arange(order.shape[0], dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[expert]
    where = jnp.where(rank < capacity, expert * capacity + rank, num_experts * capacity)
    buf = jnp.zeros((num_experts * capacity, h), tokens.dtype).at[where].set(
        tokens[order // ids.shape[1]], mode="drop")                    # past the capacity: dropped
    got = lax.all_to_all(buf.reshape(n, el * capacity, h), axis, 0, 0)  # [source, el * C, H]
    rows = got.reshape(n, el, capacity, h).transpose(1, 0, 2, 3).reshape(-1, h)
    # The way back: slot s's row is row where[inverse[s]] of the returned [E * C] rows.
    return rows, jnp.full((el,), n * capacity, jnp.int32), (where[_inverse(order)], capacity,
                                                            axis)


def a2a_capacity_combine(y: jax.Array, weights: jax.Array, state) -> jax.Array:
    """The rows back to their sources (the transposed all_to_all), each
    slot's row picked out (zeros for a dropped slot), weighted and summed."""
    where, capacity, axis = state
    n, h = lax.axis_size(axis), y.shape[1]
    blocks = y.reshape(-1, n, capacity, h).transpose(1, 0, 2, 3).reshape(n, -1, h)
    back = lax.all_to_all(blocks, axis, 0, 0).reshape(-1, h)           # [E * C, H]
    return _weighted_sum(jnp.take(back, where, axis=0, mode="fill", fill_value=0), weights)
