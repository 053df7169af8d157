"""pk_jax.flax: Flax NNX layers over pk_jax's collectives, for use inside
`jax.shard_map` (see `pk_jax.flax.layers` for the pattern), and drop-ins
(`dot_general`, `attention_fn`) for unmodified Flax models under plain
`jax.jit` (see `pk_jax.flax.dropins`). The layers take FP8 recipes
(`fp8=`); delayed scaling's state and its update: `pk_jax.flax.fp8`."""

from pk_jax.flax._common import init_sharded, partition_specs, shard_size
from pk_jax.flax.dropins import attention_fn, dot_general
from pk_jax.flax.fp8 import (Fp8AmaxHistory, Fp8GradAmaxHistory, Fp8Scaling, fp8_wrt,
                             update_fp8_state)
from pk_jax.flax.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RingSelfAttention,
    RowParallelLinear,
)
from pk_jax.flax.moe import MoE

__all__ = [
    "ColumnParallelLinear",
    "Fp8AmaxHistory",
    "Fp8GradAmaxHistory",
    "Fp8Scaling",
    "MoE",
    "ParallelMLP",
    "RingSelfAttention",
    "RowParallelLinear",
    "attention_fn",
    "dot_general",
    "fp8_wrt",
    "init_sharded",
    "partition_specs",
    "shard_size",
    "update_fp8_state",
]
