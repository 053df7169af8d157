"""`MoE`: a top-k mixture of SwiGLU experts, expert parallel over a mesh axis.

Called per shard inside `jax.shard_map` (the pattern of pk_jax.flax.layers):
each device of `axis_name` holds `num_experts / n` experts and its own
tokens (the expert axis doubles as a data axis, as usual for expert
parallelism). `pk_jax.moe_dispatch` sends every token to its top-k experts'
devices, the experts run as grouped GEMMs (`pk_jax.grouped_matmul`) over the
rows grouped by local expert, and `pk_jax.moe_combine` brings the rows back,
weighted by the router probabilities.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pk_jax.flax._common import SPEC_KEY, check_positive, new_param, shard_size
from pk_jax.ops.grouped_matmul import grouped_matmul
from pk_jax.ops.moe import MECHANISMS, moe_combine, moe_dispatch

# Each expert's [in, out] kernel gets LeCun-normal init over its own fan-in
# (the expert dim is a batch dim, not part of the fan-in).
default_expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                        batch_axis=(0,))
default_router_init = nnx.initializers.normal(0.02)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts: `sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`
    over each token's top-k experts e = ids_j, expert parallel over `axis_name`.

    Parameters (global shapes; `pk_spec` metadata gives their layout):
      router [features, num_experts] (replicated, float32 routing), gate and
      up [num_experts, features, hidden], down [num_experts, hidden,
      features], sharded over `axis_name` along the expert dim.

    Routing: softmax over the router logits (fp32), top-k, and (with
    `normalize_weights`) the k weights renormalized to sum to 1.

    Args:
      features: model width.
      hidden_features: each expert's hidden width.
      num_experts: global expert count, a multiple of `num_shards`.
      top_k: experts per token, 1..num_experts.
      axis_name: the expert mesh axis.
      num_shards: devices of `axis_name` (checked at call time).
      rngs: parameter keys.
      capacity: None (drop-less) or rows kept per local expert (see
        `pk_jax.moe_dispatch`).
      dtype: computation dtype of the experts (None: the input's).
      param_dtype: parameter dtype.
      mechanism: moe_dispatch's mechanism ("auto", "ld_st", "ragged", "xla").
      normalize_weights: renormalize the top-k probabilities.
    """

    def __init__(self, features: int, hidden_features: int, num_experts: int, top_k: int, *,
                 axis_name: str, num_shards: int, rngs: nnx.Rngs,
                 capacity: int | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, mechanism: str = "auto",
                 normalize_weights: bool = True,
                 kernel_init=default_expert_init, router_init=default_router_init) -> None:
        check_positive(features=features, hidden_features=hidden_features,
                       num_experts=num_experts, top_k=top_k, num_shards=num_shards)
        if top_k > num_experts:
            raise ValueError(f"pk_jax.flax.MoE: top_k={top_k} must be at most "
                             f"num_experts={num_experts}")
        if mechanism not in MECHANISMS:
            raise ValueError(f"pk_jax.flax.MoE: mechanism must be one of {MECHANISMS}, got "
                             f"{mechanism!r}")
        local = shard_size(num_experts, num_shards, "num_experts")
        self.features, self.hidden_features = features, hidden_features
        self.num_experts, self.top_k, self.num_shards = num_experts, top_k, num_shards
        self.axis_name, self.capacity, self.mechanism = axis_name, capacity, mechanism
        self.dtype, self.normalize_weights = dtype, normalize_weights
        self.router = nnx.Param(router_init(rngs.params(), (features, num_experts),
                                            jnp.float32), **{SPEC_KEY: P()})
        spec = P(axis_name)
        self.gate = new_param(rngs, kernel_init, (local, features, hidden_features),
                              param_dtype, spec)
        self.up = new_param(rngs, kernel_init, (local, features, hidden_features),
                            param_dtype, spec)
        self.down = new_param(rngs, kernel_init, (local, hidden_features, features),
                              param_dtype, spec)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights [T, k] float32, expert ids [T, k] int32) of tokens x [T, features]."""
        logits = jnp.dot(x.astype(jnp.float32), self.router[...])
        weights, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.normalize_weights:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids.astype(jnp.int32)

    # The grouped GEMM the experts run (jax.lax.ragged_dot's signature).
    grouped_dot = staticmethod(grouped_matmul)

    def experts(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The local experts on rows grouped by expert (`group_sizes` rows each)."""
        dt = rows.dtype
        dot = lambda a, w: self.grouped_dot(a, w[...].astype(dt), group_sizes,
                                            preferred_element_type=jnp.float32)
        h = (jax.nn.silu(dot(rows, self.gate)) * dot(rows, self.up)).astype(dt)
        return dot(h, self.down).astype(dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., features] (this device's tokens) -> [..., features]."""
        if x.shape[-1] != self.features:
            raise ValueError(f"pk_jax.flax.MoE: input has {x.shape[-1]} features, the layer "
                             f"{self.features}")
        n = lax.axis_size(self.axis_name)
        if n != self.num_shards:
            raise ValueError(f"pk_jax.flax.MoE: built for num_shards={self.num_shards}, but "
                             f"axis {self.axis_name!r} has {n} devices")
        dt = jnp.dtype(self.dtype) if self.dtype is not None else x.dtype
        tokens = x.reshape(-1, self.features)
        weights, ids = self.route(tokens)
        rows, layout = moe_dispatch(tokens.astype(dt), ids, self.axis_name,
                                    num_experts=self.num_experts, capacity=self.capacity,
                                    mechanism=self.mechanism)
        out = moe_combine(self.experts(rows, layout.group_sizes), weights, layout)
        return out.reshape(x.shape).astype(dt)
