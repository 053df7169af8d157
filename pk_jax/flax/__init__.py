"""pk_jax.flax: Flax NNX layers over pk_jax's collectives, for use inside
`jax.shard_map` (see `pk_jax.flax.layers` for the pattern)."""

from pk_jax.flax.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RingSelfAttention,
    RowParallelLinear,
    init_sharded,
    partition_specs,
    shard_size,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "RingSelfAttention",
    "RowParallelLinear",
    "init_sharded",
    "partition_specs",
    "shard_size",
]
