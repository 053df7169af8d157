"""Flax NNX layers that call pk_jax's collectives, for use inside `jax.shard_map`.

The model code runs per shard: a module holds this device's parameter
shards, and its call is traced inside the shard_map body. Every parameter
records how it is laid out over the mesh in its `pk_spec` metadata (a
`PartitionSpec` of the global parameter), so `partition_specs` gives the
shard_map specs of a module's state. The pattern:

    graphdef, state = init_sharded(lambda: Model(..., rngs=nnx.Rngs(0)), mesh)
    # state holds the *global* parameters, laid out over the mesh

    @jax.shard_map(mesh=mesh, in_specs=(partition_specs(state), P("tp")),
                   out_specs=P("tp"))
    def apply(state, x):            # state: this device's shards
        return nnx.merge(graphdef, state)(x)

Gradients with respect to `state` (outside the shard_map) come back as
global arrays in the same layout, ready for an optax update.

Token rows: the tensor-parallel linears take activations whose *first* dim
is sharded over their axis (rows of tokens: Megatron's sequence
parallelism, or the batch dim of [B, S, F]); `ColumnParallelLinear` gathers
them inside its matmul and `RowParallelLinear` scatters them back.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pk_jax.flax._common import Initializer, check_positive, new_param
from pk_jax.flax._common import init_sharded, partition_specs, shard_size  # noqa: F401 (public)
from pk_jax.ops.ring_attention import LAYOUTS, ring_attention
from pk_jax.ops.tp_matmul import (ALL_REDUCE_MECHANISMS, MECHANISMS, all_gather_matmul,
                                  matmul_all_reduce, matmul_reduce_scatter)

AxisName = str | tuple[str, ...] | None

default_kernel_init: Initializer = nnx.initializers.lecun_normal()
default_bias_init: Initializer = nnx.initializers.zeros_init()


# ---- helpers ---------------------------------------------------------------------
def _check_mechanism(mechanism: str, mechanisms: tuple[str, ...] = MECHANISMS) -> None:
    if mechanism not in mechanisms:
        raise ValueError(f"pk_jax.flax: mechanism must be one of {mechanisms}, "
                         f"got {mechanism!r}")


# ---- linear layers -------------------------------------------------------------
class _ParallelLinear(nnx.Module):
    """Kernel [in, out] (+ bias [out]) of local shapes, their global specs,
    input checks and dtype promotion; subclasses choose the layout and the
    matmul."""

    def __init__(self, in_features: int, out_features: int, *, axis_name: AxisName,
                 kernel_spec: P, bias_spec: P, rngs: nnx.Rngs, dtype: Any, param_dtype: Any,
                 use_bias: bool, mechanism: str, kernel_init: Initializer,
                 bias_init: Initializer, mechanisms: tuple[str, ...] = MECHANISMS) -> None:
        check_positive(in_features=in_features, out_features=out_features)
        _check_mechanism(mechanism, mechanisms)
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.mechanism = axis_name, mechanism
        self.dtype, self.param_dtype = dtype, param_dtype
        self.kernel = new_param(rngs, kernel_init, (in_features, out_features), param_dtype,
                                kernel_spec)
        self.bias = (new_param(rngs, bias_init, (out_features,), param_dtype, bias_spec)
                     if use_bias else None)

    def _operands(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x and the kernel, checked and promoted to the computation dtype."""
        x = jnp.asarray(x)
        if x.ndim < 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"pk_jax.flax.{type(self).__name__}: expected input "
                             f"[rows, ..., {self.in_features}], got shape {x.shape}")
        dtype = self.dtype or jnp.result_type(x, self.kernel[...])
        return x.astype(dtype), self.kernel[...].astype(dtype)

    def _add_bias(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class ColumnParallelLinear(_ParallelLinear):
    """y = all_gather(x) @ W (+ b), with the columns of W sharded.

    Sharding over `axis_name` (n devices):
      * input x [rows_local, ..., in_features]: the first dim is sharded;
      * kernel [in_features, out_features_local]: global [in, n * out_local],
        columns sharded (spec P(None, axis)); bias [out_local], spec P(axis);
      * output [n * rows_local, ..., out_features_local]: all rows, this
        device's columns.
    Communication: the all-gather of x, overlapped with the matmul
    (`pk_jax.all_gather_matmul`); the backward pass reduce-scatters dx.
    With axis_name=None the layer is a plain replicated Linear (no
    communication).
    """

    def __init__(self, in_features: int, out_features_local: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init) -> None:
        super().__init__(in_features, out_features_local, axis_name=axis_name,
                         kernel_spec=P(None, axis_name), bias_spec=P(axis_name), rngs=rngs,
                         dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         mechanism=mechanism, kernel_init=kernel_init, bias_init=bias_init)

    def __call__(self, x: jax.Array, *, return_gathered: bool = False):
        """y [n * rows_local, ..., out_local]; with return_gathered also the
        gathered input, for further projections of it (`apply_gathered`)."""
        x, kernel = self._operands(x)
        if self.axis_name is None:
            y, gathered = x @ kernel, x
        elif return_gathered:
            y, gathered = all_gather_matmul(x, kernel, self.axis_name, return_gathered=True,
                                            mechanism=self.mechanism)
        else:
            y = all_gather_matmul(x, kernel, self.axis_name, mechanism=self.mechanism)
        y = self._add_bias(y)
        return (y, gathered) if return_gathered else y

    def apply_gathered(self, x_gathered: jax.Array) -> jax.Array:
        """The layer on an input that is already gathered (all rows), e.g. the
        second output of another layer's call with return_gathered=True:
        a local matmul, no communication."""
        x, kernel = self._operands(x_gathered)
        return self._add_bias(x @ kernel)


REDUCTIONS = ("reduce_scatter", "all_reduce")


class RowParallelLinear(_ParallelLinear):
    """y = reduce_scatter(x @ W) (+ b), or all_reduce(x @ W) (+ b), with the
    rows of W sharded.

    Sharding over `axis_name` (n devices):
      * input x [rows, ..., in_features_local]: all rows, this device's
        share of the features (e.g. a ColumnParallelLinear's output);
      * kernel [in_features_local, out_features]: global [n * in_local, out],
        rows sharded (spec P(axis, None)); bias [out_features], replicated,
        added once after the reduction;
      * output: reduce="reduce_scatter" (the default) [rows / n, ...,
        out_features], the first dim sharded again (sequence parallelism;
        rows must divide by n); reduce="all_reduce" [rows, ...,
        out_features], replicated (Megatron without sequence parallelism,
        tensor-parallel decoding).
    Communication: the reduction of the partial products, fused with the
    matmul (`pk_jax.matmul_reduce_scatter` or `pk_jax.matmul_all_reduce`);
    the backward pass all-gathers dy (reduce_scatter) or needs nothing
    (all_reduce: dy is replicated). With axis_name=None the layer is a plain
    replicated Linear.
    """

    def __init__(self, in_features_local: int, out_features: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 reduce: str = "reduce_scatter",
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"pk_jax.flax.RowParallelLinear: reduce must be one of "
                             f"{REDUCTIONS}, got {reduce!r}")
        self.reduce = reduce
        super().__init__(in_features_local, out_features, axis_name=axis_name,
                         kernel_spec=P(axis_name, None), bias_spec=P(), rngs=rngs,
                         dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         mechanism=mechanism, kernel_init=kernel_init, bias_init=bias_init,
                         mechanisms=(ALL_REDUCE_MECHANISMS if reduce == "all_reduce"
                                     else MECHANISMS))

    def __call__(self, x: jax.Array) -> jax.Array:
        """y [rows / n, ..., out_features] (reduce_scatter) or [rows, ...,
        out_features] (all_reduce)."""
        x, kernel = self._operands(x)
        if self.axis_name is None:
            return self._add_bias(x @ kernel)
        op = matmul_all_reduce if self.reduce == "all_reduce" else matmul_reduce_scatter
        return self._add_bias(op(x, kernel, self.axis_name, mechanism=self.mechanism))


# ---- blocks --------------------------------------------------------------------
class ParallelMLP(nnx.Module):
    """Gated MLP, down(act(gate(x)) * up(x)), tensor parallel over `axis_name`.

    Sharding (n devices): input and output [rows_local, ..., features] with
    the first dim sharded; gate and up are ColumnParallelLinear (kernels
    [features, hidden_local], global columns sharded), down is
    RowParallelLinear (kernel [hidden_local, features], rows sharded).
    Communication: one all-gather of x (fused into the gate matmul; the up
    projection reuses the gathered rows) and one reduce-scatter (fused into
    the down matmul); their transposes in the backward pass.
    """

    def __init__(self, features: int, hidden_features_local: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
                 kernel_init: Initializer = default_kernel_init) -> None:
        common = dict(axis_name=axis_name, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                      use_bias=use_bias, mechanism=mechanism, kernel_init=kernel_init)
        self.gate = ColumnParallelLinear(features, hidden_features_local, **common)
        self.up = ColumnParallelLinear(features, hidden_features_local, **common)
        self.down = RowParallelLinear(hidden_features_local, features, **common)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, gathered = self.gate(x, return_gathered=True)
        return self.down(self.activation(gate) * self.up.apply_gathered(gathered))


class RingSelfAttention(nnx.Module):
    """Self-attention over a sequence sharded along `axis_name` (ring
    attention), with grouped-query heads; optionally tensor parallel over
    the heads along `tp_axis_name`.

    Sharding: input and output x [batch, seq_local, in_features]: the
    sequence (dim 1) is sharded over `axis_name` (layout "contiguous" or
    "zigzag", see `pk_jax.ring_attention`).
      * tp_axis_name=None: the q/k/v/output projections are replicated and
        local (no communication); num_heads / num_kv_heads are the model's.
      * tp_axis_name="tp" (t devices): the batch (dim 0) is also sharded
        over "tp" outside the layer; num_heads / num_kv_heads are this
        device's heads (the model's divided by t); q/k/v are
        ColumnParallelLinear (heads sharded, one all-gather of x over "tp"),
        the output projection is RowParallelLinear (reduce-scatter over
        "tp" back to the batch shard).
    Communication: `pk_jax.ring_attention` passes the K/V blocks around the
    `axis_name` ring; plus the "tp" gather/scatter above.

    `attention_fn(q, k, v, axis_name, *, causal, layout) -> o` ([batch,
    seq_local, heads, head_dim] per shard) replaces `pk_jax.ring_attention`
    when given, e.g. a baseline to compare pk_jax against (the projections
    keep `mechanism`).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, in_features: int, *,
                 axis_name: str | Sequence[str], tp_axis_name: AxisName = None,
                 causal: bool = True, layout: str = "contiguous", rngs: nnx.Rngs,
                 dtype: Any = None, param_dtype: Any = jnp.float32, use_bias: bool = False,
                 mechanism: str = "auto",
                 kernel_init: Initializer = default_kernel_init,
                 attention_fn: Callable | None = None) -> None:
        check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if num_heads % num_kv_heads:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: num_heads ({num_heads}) must be "
                             f"a multiple of num_kv_heads ({num_kv_heads})")
        if layout not in LAYOUTS:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: layout must be one of "
                             f"{LAYOUTS}, got {layout!r}")
        common = dict(axis_name=tp_axis_name, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                      use_bias=use_bias, mechanism=mechanism, kernel_init=kernel_init)
        self.q = ColumnParallelLinear(in_features, num_heads * head_dim, **common)
        self.k = ColumnParallelLinear(in_features, num_kv_heads * head_dim, **common)
        self.v = ColumnParallelLinear(in_features, num_kv_heads * head_dim, **common)
        self.out = RowParallelLinear(num_heads * head_dim, in_features, **common)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.axis_name, self.causal, self.layout = axis_name, causal, layout
        self.mechanism = mechanism
        self.attention_fn = attention_fn

    def __call__(self, x: jax.Array) -> jax.Array:
        if jnp.ndim(x) != 3:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: expected x [batch, seq_local, "
                             f"features], got shape {jnp.shape(x)}")
        q, gathered = self.q(x, return_gathered=True)
        k, v = self.k.apply_gathered(gathered), self.v.apply_gathered(gathered)
        b, s = q.shape[:2]
        heads = lambda a, h: a.reshape(b, s, h, self.head_dim)
        q, k, v = heads(q, self.num_heads), heads(k, self.num_kv_heads), heads(v, self.num_kv_heads)
        if self.attention_fn is not None:
            o = self.attention_fn(q, k, v, self.axis_name, causal=self.causal, layout=self.layout)
        else:
            o = ring_attention(q, k, v, self.axis_name, causal=self.causal, layout=self.layout,
                               mechanism="xla" if self.mechanism == "xla" else "auto")
        return self.out(o.reshape(b, s, self.num_heads * self.head_dim))
