"""The tensor-parallel MLP pair the tests share: sequence-sharded x, a
column-parallel then a row-parallel layer (Megatron style)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import pk_jax


def mlp_pair(mesh, axis: str, pk: bool, mechanism: str = "auto"):
    """shard_mapped f(x, w1, w2) -> this device's rows of gelu(x @ w1) @ w2,
    with pk_jax's ops (pk=True, with `mechanism`) or XLA's collectives and dots."""
    def body(x, w1, w2):
        if pk:
            h = pk_jax.all_gather_matmul(x, w1, axis, mechanism=mechanism)
            return pk_jax.matmul_reduce_scatter(jax.nn.gelu(h), w2, axis, mechanism=mechanism)
        h = lax.all_gather(x, axis, tiled=True) @ w1
        return lax.psum_scatter(jax.nn.gelu(h) @ w2, axis, scatter_dimension=0, tiled=True)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(None, axis), P(axis, None)),
                         out_specs=P(axis))


def mlp_loss(mesh, axis: str, pk: bool, x, w1, w2, mechanism: str = "auto"):
    """A scalar loss over the pair's output, computed in fp32."""
    return jnp.sum(jnp.sin(mlp_pair(mesh, axis, pk, mechanism)(x, w1, w2).astype(jnp.float32)))
