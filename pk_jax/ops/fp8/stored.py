"""FP8 operands as stored: `Fp8Weight` and `Fp8Activation`, passed to
`pk_jax.fp8_dot` and the tensor-parallel matmuls in place of bf16 operands;
the ops then quantize only what is not stored (the other operand, the
gradients).

`Fp8Weight`: a weight in FP8 with its dequantization factors, as FP8
checkpoints keep them (DeepSeek-V3's e4m3 weights with a factor per 128x128
block). The layout is the FP8 GEMM's: `data` [N, K] row-major (K-major, the B
operand Hopper's FP8 tensor cores read; PyTorch's Linear layout), for the
weight w [K, N] of `x @ w`. `factors` tile `data` as stored: one float32
("tensor") or [ceil(N/128), ceil(K/128)] ("block"), w[k, n] ~= data[n, k] *
factor(n // 128, k // 128).

`Fp8Activation`: activations x [..., K] in FP8 with their factors, as an
FP8 inference stack or a fused quantizing epilogue produces them: `data`
[..., K] e4m3, one factor ("tensor") or a factor per 1x128 along K
([..., ceil(K/128)], DeepSeek-V3's activation tiles: "block").

A stored operand is a constant of the computation: the ops compute the other
operand's gradient through it, and its own cotangent is zero (as through
`lax.stop_gradient`); train with `fp8=` on bf16 operands instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pk_jax.ops.fp8 import primitive as prim

SCALINGS = ("tensor", "block")
# The recipe an Fp8Weight's activations and gradients are quantized by.
RECIPE_OF = {"tensor": "current", "block": "block"}


class _Stored:
    """What both stored kinds share: the pytree of (data, factors) with the
    scaling as static data, the element type (FP8), size and repr."""

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
        return (f"{type(self).__name__}(shape={self.shape}, scaling={self.scaling!r}, "
                f"data={getattr(self.data, 'dtype', self.data)})")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(self.data.dtype)


@jax.tree_util.register_pytree_node_class
class Fp8Weight(_Stored):
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

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N): the shape of the weight w it stands for."""
        n, k = self.data.shape
        return (k, n)

    ndim = 2

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
        data, factors = _checked_types(where, self)
        if data.ndim != 2 or 0 in data.shape:
            raise ValueError(f"{where}: Fp8Weight.data must be [N, K] (w transposed), got "
                             f"shape {data.shape}")
        n, k = data.shape
        want = (prim.blocks(n), prim.blocks(k))
        if self.scaling == "tensor" and factors.size != 1:
            raise ValueError(f"{where}: Fp8Weight(scaling='tensor') takes one factor (shape () "
                             f"or (1,)), got shape {factors.shape}")
        if self.scaling == "block" and factors.shape != want:
            raise ValueError(f"{where}: Fp8Weight(scaling='block') of data {data.shape} takes "
                             f"factors [ceil(N/128), ceil(K/128)] = {want}, got "
                             f"{factors.shape}")


def _checked_types(where: str, stored):
    """(data, factors) of a stored operand as arrays, after the checks both
    kinds share: its scaling, e4m3 data, float32 factors."""
    kind = type(stored).__name__
    if stored.scaling not in SCALINGS:
        raise ValueError(f"{where}: {kind}(scaling={stored.scaling!r}): expected one of "
                         f"{SCALINGS}")
    data, factors = jnp.asarray(stored.data), jnp.asarray(stored.factors)
    if jnp.dtype(data.dtype) != prim.E4M3:
        raise TypeError(f"{where}: {kind}.data must be float8_e4m3fn, got {data.dtype}")
    if jnp.dtype(factors.dtype) != jnp.float32:
        raise TypeError(f"{where}: {kind}.factors must be float32, got {factors.dtype}")
    return data, factors


@jax.tree_util.register_pytree_node_class
class Fp8Activation(_Stored):
    """x [..., K] stored as FP8 `data` (float8_e4m3fn) with its factors.

    Args:
      data: [..., K] float8_e4m3fn (leading dims are rows).
      factors: "tensor": one float32 (shape () or (1,)); "block": float32
        [..., ceil(K/128)], the factor of each 1x128 tile of a row.
      scaling: "tensor" or "block"; the ops quantize the other operands and
        the gradients by the recipe it implies ("current" or "block").

    Make one with `pk_jax.quantize_activation(x, scaling)` or from another
    stack's arrays; x ~= `dequantize()`. `shape` and `dtype` are the data's.
    Inside `jax.shard_map` `partition_spec(spec)` gives its in_specs. An
    activation gathered by `all_gather_matmul` with one tensor factor needs
    that factor to be one value over the axis (`quantize_activation`'s
    `axis_name`): the gathered rows form one FP8 operand.
    """

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "Fp8Activation":
        """The same activation with its rows reshaped (the last dim, K,
        stays): e.g. reshape(-1, K) for the 2-D GEMM operand."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape[-1] != self.shape[-1]:
            raise ValueError(f"Fp8Activation.reshape: K ({self.shape[-1]}) stays last, got "
                             f"{shape}")
        factors = (self.factors if self.scaling == "tensor" else
                   jnp.reshape(self.factors, shape[:-1] + (jnp.shape(self.factors)[-1],)))
        return Fp8Activation(jnp.reshape(self.data, shape), factors, self.scaling)

    def dequantize(self, dtype=jnp.float32):
        """data * factors in `dtype` (x as stored)."""
        x = jnp.asarray(self.data).astype(jnp.float32)
        f = jnp.asarray(self.factors, jnp.float32)
        if self.scaling == "tensor":
            return (x * f.reshape(())).astype(dtype)
        return (x * jnp.repeat(f, 128, axis=-1)[..., :x.shape[-1]]).astype(dtype)

    def partition_spec(self, spec) -> "Fp8Activation":
        """The in_specs of this activation sharded as x with `spec` (a
        PartitionSpec of its dims): block factors follow the rows, one
        tensor factor is replicated."""
        spec = tuple(spec) + (None,) * (self.ndim - len(tuple(spec)))
        if len(spec) != self.ndim:
            raise ValueError(f"Fp8Activation.partition_spec: a spec of x {self.shape}, got "
                             f"{spec}")
        factors = P(*spec[:-1], None) if self.scaling == "block" else P()
        return Fp8Activation(P(*spec), factors, self.scaling)

    def validate(self, where: str) -> None:
        """ValueError / TypeError naming what is wrong (called by the ops)."""
        data, factors = _checked_types(where, self)
        if data.ndim < 1 or 0 in data.shape:
            raise ValueError(f"{where}: Fp8Activation.data must be [..., K], got shape "
                             f"{data.shape}")
        if self.scaling == "tensor" and factors.size != 1:
            raise ValueError(f"{where}: Fp8Activation(scaling='tensor') takes one factor "
                             f"(shape () or (1,)), got shape {factors.shape}")
        want = data.shape[:-1] + (prim.blocks(data.shape[-1]),)
        if self.scaling == "block" and factors.shape != want:
            raise ValueError(f"{where}: Fp8Activation(scaling='block') of data {data.shape} "
                             f"takes factors [..., ceil(K/128)] = {want}, got "
                             f"{factors.shape}")


def is_stored(a) -> bool:
    """Whether `a` is an FP8 operand as stored (no quantization in the op)."""
    return isinstance(a, (Fp8Weight, Fp8Activation))
