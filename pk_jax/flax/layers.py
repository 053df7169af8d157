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

FP8: the linears, `ParallelMLP` and `RingSelfAttention` take
`fp8=None | pk_jax.Fp8Recipe | "current" | "delayed" | "block"`: their
matmuls run pk_jax's FP8 TP ops (`pk_jax.fp8_dot` without an axis), the
parameters stay in `param_dtype`. With "delayed" each FP8 matmul keeps amax
histories (`Fp8Scaling`, variables `Fp8AmaxHistory` / `Fp8GradAmaxHistory`)
and a training step applies `update_fp8_state(model, grads)` with gradients
taken with respect to `fp8_wrt()` (pk_jax/flax/fp8.py says why and how).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from pk_jax.flax._common import Initializer, check_positive, new_param
from pk_jax.flax._common import init_sharded, partition_specs, shard_size  # noqa: F401 (public)
from pk_jax.flax.fp8 import (QUANTIZED_DTYPES, Fp8Scaling, check_fp8, fp8_project,
                             fp8_recipe, split_columns)
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


def _fp8_setup(module: nnx.Module, fp8, mechanism: str, **sizes: int) -> None:
    """The module's `fp8` (an Fp8Recipe or None), checked against its
    mechanism and sizes (`check_fp8`)."""
    where = f"pk_jax.flax.{type(module).__name__}"
    module.fp8 = fp8_recipe(fp8, where)
    check_fp8(where, module.fp8, mechanism, **sizes)


def _fp8_state(recipe) -> Fp8Scaling | None:
    """Delayed scaling's state of one FP8 matmul (None for other recipes)."""
    return Fp8Scaling(recipe) if recipe is not None and recipe.scaling == "delayed" else None


# ---- linear layers -------------------------------------------------------------
class _ParallelLinear(nnx.Module):
    """Kernel [in, out] (+ bias [out]) of local shapes, their global specs,
    input checks and dtype promotion; subclasses choose the layout and the
    matmul."""

    def __init__(self, in_features: int, out_features: int, *, axis_name: AxisName,
                 kernel_spec: P, bias_spec: P, rngs: nnx.Rngs, dtype: Any, param_dtype: Any,
                 use_bias: bool, mechanism: str, kernel_init: Initializer,
                 bias_init: Initializer, fp8, feature_names: tuple[str, str],
                 mechanisms: tuple[str, ...] = MECHANISMS) -> None:
        check_positive(in_features=in_features, out_features=out_features)
        _check_mechanism(mechanism, mechanisms)
        _fp8_setup(self, fp8, mechanism, **dict(zip(feature_names, (in_features, out_features))))
        self.fp8_state = _fp8_state(self.fp8)
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.mechanism = axis_name, mechanism
        self.dtype, self.param_dtype = dtype, param_dtype
        self.kernel = new_param(rngs, kernel_init, (in_features, out_features), param_dtype,
                                kernel_spec)
        self.bias = (new_param(rngs, bias_init, (out_features,), param_dtype, bias_spec)
                     if use_bias else None)

    def _operands(self, x: jax.Array, *, quantized: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
        """x and the kernel, checked and promoted to the computation dtype;
        with `quantized` (an FP8 matmul quantizes the kernel) the kernel as
        stored where the quantization reads its dtype: one rounding instead
        of two, no conversion pass over it, and its gradient written in the
        parameter's dtype by the weight-gradient GEMM."""
        x = jnp.asarray(x)
        if x.ndim < 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"pk_jax.flax.{type(self).__name__}: expected input "
                             f"[rows, ..., {self.in_features}], got shape {x.shape}")
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(x, kernel)
        if quantized and jnp.dtype(kernel.dtype) in QUANTIZED_DTYPES:
            return x.astype(dtype), kernel
        return x.astype(dtype), kernel.astype(dtype)

    def _add_bias(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def _axis_size(axis_name) -> int:
    """The devices along `axis_name` (1 for None: a replicated layer)."""
    return 1 if axis_name is None else lax.axis_size(axis_name)


def _fused_columns(layers: Sequence["ColumnParallelLinear"], x: jax.Array, recipe,
                   scaling: Fp8Scaling | None) -> list[jax.Array]:
    """Column-parallel layers of one axis applied to one x in FP8: each
    layer's output, with its bias. As one FP8 matmul (their kernels side by
    side: one all-gather of the quantized rows, one scale for the joined
    kernel) where the axis has several devices or delayed scaling keeps one
    state for them; on one device without that state, one FP8 matmul each:
    no all-gather to share, and no concatenation of the kernels (forward)
    and of the output gradients (backward), which cost more than quantizing
    x once per layer (benchmarks/NOTES.md, 2026-12-06, the model's step)."""
    if len(layers) > 1 and scaling is None and _axis_size(layers[0].axis_name) == 1:
        return [_fused_columns([layer], x, recipe, None)[0] for layer in layers]
    # one kernel: quantized as stored; several join in the computation dtype (their
    # conversion and concatenation one pass: joined as stored, float32, the
    # concatenation would cost more than the conversion saves)
    operands = [layer._operands(x, quantized=len(layers) == 1) for layer in layers]
    kernel = jnp.concatenate([k for _, k in operands], axis=1)
    y = fp8_project(operands[0][0], kernel, layers[0].axis_name, recipe, scaling,
                    all_gather_matmul)
    return [layer._add_bias(part)
            for layer, part in zip(layers, split_columns(y, [l.out_features for l in layers]))]


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

    fp8 (None, a pk_jax.Fp8Recipe or "current" / "delayed" / "block"): the
    matmul and its gradients in FP8 (`all_gather_matmul(fp8=...)`, which
    gathers the quantized rows; axis_name=None: `pk_jax.fp8_dot`).
    in_features and out_features_local multiples of 16 (128 for "block"),
    the input's rows per device too. With "delayed" the layer keeps its amax
    histories in `fp8_state` (an `Fp8Scaling`): the forward records amax(x)
    and amax(w); amax(dy) arrives as the gradient of `fp8_state.grad`, which
    a training step writes in with `pk_jax.flax.update_fp8_state(model,
    grads)` (gradients with respect to `pk_jax.flax.fp8_wrt()`).
    """

    def __init__(self, in_features: int, out_features_local: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, fp8=None) -> None:
        super().__init__(in_features, out_features_local, axis_name=axis_name,
                         kernel_spec=P(None, axis_name), bias_spec=P(axis_name), rngs=rngs,
                         dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         mechanism=mechanism, kernel_init=kernel_init, bias_init=bias_init,
                         fp8=fp8, feature_names=("in_features", "out_features_local"))

    def __call__(self, x: jax.Array, *, return_gathered: bool = False):
        """y [n * rows_local, ..., out_local]; with return_gathered also the
        gathered input, for further projections of it (`apply_gathered`;
        not with fp8: the gathered rows are FP8)."""
        if self.fp8 is not None:
            if return_gathered:
                raise ValueError(f"pk_jax.flax.ColumnParallelLinear(fp8="
                                 f"{self.fp8.scaling!r}): return_gathered is not available "
                                 "with fp8 (the gathered rows are FP8)")
            return _fused_columns([self], x, self.fp8, self.fp8_state)[0]
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
        a local matmul, no communication (with fp8 `pk_jax.fp8_dot`, and
        delayed scaling's state shared with __call__)."""
        x, kernel = self._operands(x_gathered, quantized=self.fp8 is not None)
        if self.fp8 is not None:
            return self._add_bias(fp8_project(x, kernel, None, self.fp8, self.fp8_state, None))
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

    fp8: as ColumnParallelLinear's (`matmul_reduce_scatter(fp8=...)`, whose
    backward gathers dy in FP8, or `matmul_all_reduce(fp8=...)`);
    in_features_local and out_features multiples of 16 (128 for "block").
    """

    def __init__(self, in_features_local: int, out_features: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 reduce: str = "reduce_scatter",
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, fp8=None) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"pk_jax.flax.RowParallelLinear: reduce must be one of "
                             f"{REDUCTIONS}, got {reduce!r}")
        self.reduce = reduce
        super().__init__(in_features_local, out_features, axis_name=axis_name,
                         kernel_spec=P(axis_name, None), bias_spec=P(), rngs=rngs,
                         dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                         mechanism=mechanism, kernel_init=kernel_init, bias_init=bias_init,
                         fp8=fp8, feature_names=("in_features_local", "out_features"),
                         mechanisms=(ALL_REDUCE_MECHANISMS if reduce == "all_reduce"
                                     else MECHANISMS))

    def __call__(self, x: jax.Array) -> jax.Array:
        """y [rows / n, ..., out_features] (reduce_scatter) or [rows, ...,
        out_features] (all_reduce)."""
        x, kernel = self._operands(x, quantized=self.fp8 is not None)
        op = matmul_all_reduce if self.reduce == "all_reduce" else matmul_reduce_scatter
        if self.fp8 is not None:
            return self._add_bias(fp8_project(x, kernel, self.axis_name, self.fp8,
                                              self.fp8_state, op))
        if self.axis_name is None:
            return self._add_bias(x @ kernel)
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

    fp8 (as ColumnParallelLinear's): gate and up run as one FP8
    all_gather_matmul (their kernels side by side, split after: the gathered
    rows are FP8, so they cannot be reused), down as an FP8
    matmul_reduce_scatter. features and hidden_features_local multiples of
    16 (128 for "block"). The parameters are those of the bf16 MLP (gate,
    up, down); with "delayed" the joined gate|up matmul keeps its histories
    in `gate_up_fp8_state` (gate and up have none) and down in
    `down.fp8_state`.
    """

    def __init__(self, features: int, hidden_features_local: int, *, axis_name: AxisName,
                 rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32,
                 use_bias: bool = False, mechanism: str = "auto",
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
                 kernel_init: Initializer = default_kernel_init, fp8=None) -> None:
        _fp8_setup(self, fp8, mechanism, features=features,
                   hidden_features_local=hidden_features_local)
        common = dict(axis_name=axis_name, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                      use_bias=use_bias, mechanism=mechanism, kernel_init=kernel_init)
        self.gate = ColumnParallelLinear(features, hidden_features_local, **common)
        self.up = ColumnParallelLinear(features, hidden_features_local, **common)
        self.down = RowParallelLinear(hidden_features_local, features, fp8=self.fp8, **common)
        self.gate_up_fp8_state = _fp8_state(self.fp8)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8 is not None:
            gate, up = _fused_columns([self.gate, self.up], x, self.fp8, self.gate_up_fp8_state)
        else:
            gate, gathered = self.gate(x, return_gathered=True)
            up = self.up.apply_gathered(gathered)
        return self.down(self.activation(gate) * up)


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

    fp8 (as ColumnParallelLinear's): the projections in FP8, q, k and v as
    one matmul (their kernels side by side; delayed scaling's state in
    `qkv_fp8_state`), the output projection as an FP8 RowParallelLinear;
    attention itself stays in the computation dtype. in_features,
    (num_heads + 2 * num_kv_heads) * head_dim and num_heads * head_dim
    multiples of 16 (128 for "block").
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, in_features: int, *,
                 axis_name: str | Sequence[str], tp_axis_name: AxisName = None,
                 causal: bool = True, layout: str = "contiguous", rngs: nnx.Rngs,
                 dtype: Any = None, param_dtype: Any = jnp.float32, use_bias: bool = False,
                 mechanism: str = "auto",
                 kernel_init: Initializer = default_kernel_init,
                 attention_fn: Callable | None = None, fp8=None) -> None:
        check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if num_heads % num_kv_heads:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: num_heads ({num_heads}) must be "
                             f"a multiple of num_kv_heads ({num_kv_heads})")
        if layout not in LAYOUTS:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: layout must be one of "
                             f"{LAYOUTS}, got {layout!r}")
        _fp8_setup(self, fp8, mechanism, in_features=in_features,
                   **{"(num_heads + 2 * num_kv_heads) * head_dim":
                      (num_heads + 2 * num_kv_heads) * head_dim,
                      "num_heads * head_dim": num_heads * head_dim})
        common = dict(axis_name=tp_axis_name, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                      use_bias=use_bias, mechanism=mechanism, kernel_init=kernel_init)
        self.q = ColumnParallelLinear(in_features, num_heads * head_dim, **common)
        self.k = ColumnParallelLinear(in_features, num_kv_heads * head_dim, **common)
        self.v = ColumnParallelLinear(in_features, num_kv_heads * head_dim, **common)
        self.out = RowParallelLinear(num_heads * head_dim, in_features, fp8=self.fp8, **common)
        self.qkv_fp8_state = _fp8_state(self.fp8)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.axis_name, self.causal, self.layout = axis_name, causal, layout
        self.mechanism = mechanism
        self.attention_fn = attention_fn

    def __call__(self, x: jax.Array) -> jax.Array:
        if jnp.ndim(x) != 3:
            raise ValueError(f"pk_jax.flax.RingSelfAttention: expected x [batch, seq_local, "
                             f"features], got shape {jnp.shape(x)}")
        if self.fp8 is not None:
            q, k, v = _fused_columns([self.q, self.k, self.v], x, self.fp8, self.qkv_fp8_state)
        else:
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
