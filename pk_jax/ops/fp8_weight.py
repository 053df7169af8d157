"""`Fp8Weight`: a weight stored in FP8 with its dequantization factors, as
FP8 checkpoints keep them (DeepSeek-V3's e4m3 weights with a factor per
128x128 block), passed to `pk_jax.fp8_dot` and the tensor-parallel matmuls in
place of a bf16 weight: no quantization of the weight inside the call.

The layout is the FP8 GEMM's: `data` [N, K] row-major (K-major, the B operand
Hopper's FP8 tensor cores read; PyTorch's Linear layout), for the weight
w [K, N] of `x @ w`. `factors` tile `data` as stored: one float32 ("tensor")
or [ceil(N/128), ceil(K/128)] ("block"), w[k, n] ~= data[n, k] *
factor(n // 128, k // 128).

A stored weight is a constant of the computation: the ops compute the input
gradient through it, and its own cotangent is zero (as through
`lax.stop_gradient`); train master weights with `fp8=` instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pk_jax.ops import fp8_primitive as prim

SCALINGS = ("tensor", "block")
# The recipe an Fp8Weight's activations and gradients are quantized by.
RECIPE_OF = {"tensor": "current", "block": "block"}


@jax.tree_util.register_pytree_node_class
class Fp8Weight:
    """w [K, N] stored as FP8 `data` [N, K] (float8_e4m3fn) with its factors.

    Args:
      data: [N, K] float8_e4m3fn, the weight transposed (K-major).
      factors: "tensor": one float32 (shape () or (1,)); "block": float32
        [ceil(N/128), ceil(K/128)], the factor of each 128x128 block of data.
      scaling: "tensor" or "block" (DeepSeek-V3's weight blocks; the ops then
        quantize activations and gradients per 1x128).

    Make one with `pk_jax.quantize_weight(w, scaling)` or from a checkpoint's
    arrays. `shape` and `dtype` are the weight's as the ops see it: (K, N)
    and float8_e4m3fn. Inside `jax.shard_map`, `partition_spec` gives the
    in_specs of a weight sharded like w.
    """

    def __init__(self, data, factors, scaling: str = "tensor"):
        self.data = data
        self.factors = factors
        self.scaling = scaling

    def tree_flatten(self):
        return (self.data, self.factors), self.scaling

    @classmethod
    def tree_unflatten(cls, scaling, children):
        return cls(*children, scaling=scaling)

    def __repr__(self) -> str:
        return (f"Fp8Weight(shape={self.shape}, scaling={self.scaling!r}, "
                f"data={getattr(self.data, 'dtype', self.data)})")

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N): the shape of the weight w it stands for."""
        n, k = self.data.shape
        return (k, n)

    ndim = 2

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(self.data.dtype)

    def partition_spec(self, spec) -> "Fp8Weight":
        """The in_specs (a pytree of PartitionSpecs) of this weight sharded as
        w [K, N] with `spec` (e.g. P(None, "tp") for a column-parallel
        layer): data [N, K] and block factors follow it transposed; one
        tensor factor is replicated."""
        spec = tuple(spec) + (None,) * (2 - len(tuple(spec)))
        if len(spec) != 2:
            raise ValueError(f"Fp8Weight.partition_spec: a spec of w [K, N], got {spec}")
        data = P(spec[1], spec[0])
        return Fp8Weight(data, data if self.scaling == "block" else P(), self.scaling)

    def validate(self, where: str) -> None:
        """ValueError / TypeError naming what is wrong (called by the ops)."""
        if self.scaling not in SCALINGS:
            raise ValueError(f"{where}: Fp8Weight(scaling={self.scaling!r}): expected one of "
                             f"{SCALINGS}")
        data, factors = jnp.asarray(self.data), jnp.asarray(self.factors)
        if data.ndim != 2 or 0 in data.shape:
            raise ValueError(f"{where}: Fp8Weight.data must be [N, K] (w transposed), got "
                             f"shape {data.shape}")
        if jnp.dtype(data.dtype) != prim.E4M3:
            raise TypeError(f"{where}: Fp8Weight.data must be float8_e4m3fn, got {data.dtype}")
        if jnp.dtype(factors.dtype) != jnp.float32:
            raise TypeError(f"{where}: Fp8Weight.factors must be float32, got {factors.dtype}")
        n, k = data.shape
        want = (prim.blocks(n), prim.blocks(k))
        if self.scaling == "tensor" and factors.size != 1:
            raise ValueError(f"{where}: Fp8Weight(scaling='tensor') takes one factor (shape () "
                             f"or (1,)), got shape {factors.shape}")
        if self.scaling == "block" and factors.shape != want:
            raise ValueError(f"{where}: Fp8Weight(scaling='block') of data {data.shape} takes "
                             f"factors [ceil(N/128), ceil(K/128)] = {want}, got "
                             f"{factors.shape}")
