"""Drop-ins for unmodified Flax models under plain `jax.jit`: a `dot_general`
for `nnx.Linear` / `nnx.LinearGeneral` / linen `nn.Dense` and an
`attention_fn` for `nnx.MultiHeadAttention`. Give the model sharded
parameters and inputs (NamedShardings); pk_jax's partitioning rules pick the
fused ops (see `pk_jax.partitioning`).

    layer = nnx.Linear(512, 2048, dot_general=pk_jax.flax.dot_general, rngs=rngs)
    attn = nnx.MultiHeadAttention(8, 512, attention_fn=pk_jax.flax.attention_fn,
                                  decode=False, rngs=rngs)
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pk_jax._warnings import warn_once
from pk_jax.partitioning import dot_general as _dot_general
from pk_jax.partitioning import dot_product_attention
from pk_jax._explicit import explicit_mesh, reshard, type_sharding


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision: Any = None,
                preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """`pk_jax.dot_general` with the signature Flax's layers call: pass it as
    `dot_general=` to `nnx.Linear`, `nnx.LinearGeneral` or linen `nn.Dense`.
    """
    return _dot_general(lhs, rhs, dimension_numbers, precision=precision,
                        preferred_element_type=preferred_element_type,
                        out_sharding=out_sharding)


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                 broadcast_dropout: bool = True, dropout_rng: Optional[jax.Array] = None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
                 precision: Any = None, module: Optional[nnx.Module] = None,
                 promote_dtype: Any = None, is_causal: bool = False) -> jax.Array:
    """`attention_fn` for `nnx.MultiHeadAttention`: `pk_jax.dot_product_attention`
    (ring attention when the sequence is sharded over the mesh).

    Same signature as `flax.nnx.dot_product_attention`. q/k/v are
    [batch..., length, heads, head_dim] (any number of batch dims, including
    none). The ring path takes no mask, bias, dropout or sown attention
    weights (it never materializes the weights); when any of these is given
    (`mask`/`bias` not None, `dropout_rate > 0` and not `deterministic`, or
    `module` not None, e.g. MultiHeadAttention's decode mode or
    `sow_weights=True`), the call falls back to flax's
    `nnx.dot_product_attention` with all arguments, which XLA partitions
    itself, after a one-time `PkJaxFallbackWarning`. Causal masking goes by
    `is_causal` (what `MultiHeadAttention(..., is_causal=True)` passes).
    `precision` is not used on the pk_jax path (scores and softmax run in
    fp32 on the ring; plain attention uses XLA's default).
    """
    dropout = dropout_rate > 0.0 and not deterministic
    if mask is not None or bias is not None or dropout or module is not None:
        what = [name for name, given in (("mask", mask is not None), ("bias", bias is not None),
                                         ("dropout", dropout), ("module", module is not None))
                if given]
        warn_once(f"attention_fn-{'-'.join(what)}",
                  f"pk_jax.flax.attention_fn: {', '.join(what)} given, which the ring path "
                  "cannot honour; using flax's nnx.dot_product_attention (no ring attention)")
        kwargs = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
        mesh = explicit_mesh(query, key, value)
        if mesh is not None:  # sharded keys would give an illegal scores sharding
            key, value = (_keys_unsharded(a, mesh) for a in (key, value))
        return nnx.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, is_causal=is_causal, **kwargs)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        dtype = dtype or jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(a, dtype) for a in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"pk_jax.flax.attention_fn: expected q/k/v [batch..., length, heads, "
                         f"head_dim] of one rank, got {query.shape}, {key.shape} and "
                         f"{value.shape}")
    batch = query.shape[:-3]
    to4 = lambda a: a.reshape((-1,) + a.shape[-3:])
    out = dot_product_attention(to4(query), to4(key), to4(value), causal=is_causal)
    return out.reshape(batch + out.shape[1:])


def _keys_unsharded(x: jax.Array, mesh) -> jax.Array:
    """`x` [..., length, heads, head_dim] with its length and head_dim dims
    unsharded (explicit sharding): flax's attention then contracts and
    reduces over unsharded dims, whatever the queries' sharding."""
    spec = list(type_sharding(x).spec) + [None] * x.ndim
    spec[x.ndim - 3] = spec[x.ndim - 1] = None
    return reshard(x, mesh, jax.sharding.PartitionSpec(*spec[:x.ndim]))
