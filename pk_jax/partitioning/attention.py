"""`pk_jax.dot_product_attention`: `jax.nn.dot_product_attention` for plain
`jax.jit` programs, run as `pk_jax.ring_attention` when the sequence of q/k/v
is sharded over the mesh (routing rules: `_attention_plan.py`).

Forward and backward are two `custom_partitioning` ops tied by
`jax.custom_vjp`: the backward op routes like the forward (from the same
q/k/v shardings) and runs `jax.vjp` of the per-device program it picked, so
the ring is recomputed in the backward pass (no O(S^2) residuals, the
price is a second forward). First-order only.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning

from pk_jax import _args, reference
from pk_jax._compat import xla_attention
from pk_jax.ops.ring_attention import check_qkv_arrays, check_scale, ring_attention
from pk_jax.partitioning._attention_plan import AttentionPlan, plan_attention
from pk_jax._explicit import explicit_mesh, replicated_fun, reshard, type_sharding
from pk_jax.partitioning._specs import Route, dim_axes, named, record, spec


@functools.lru_cache(maxsize=None)
def _rule(same_heads: bool, same_len: bool, vjp: bool) -> str:
    q = "b s h d"
    kv_seq, kv_heads = ("s" if same_len else "t"), ("h" if same_heads else "k")
    k = f"b {kv_seq} {kv_heads} d"
    v = f"b {kv_seq} {kv_heads} e"
    out = "b s h e"
    if vjp:
        return f"{q}, {k}, {v}, {out} -> {q}, {k}, {v}"
    return f"{q}, {k}, {v} -> {out}"


def _dense(q, k, v, *, scale: float, is_causal: bool):
    """Unsharded attention: XLA's (jax.nn.dot_product_attention), or for a
    value head dim other than q's, which jax.nn does not take, the
    pure-lax attention (fp32 scores and softmax) in q's dtype."""
    if v.shape[3] == q.shape[3]:
        return xla_attention(q, k, v, scale=scale, is_causal=is_causal)
    return reference.attention(q, k, v, causal=is_causal, scale=scale).astype(q.dtype)


def _local(plan: AttentionPlan, causal: bool, scale: float):
    """The per-device attention of a plan."""
    if plan.route == "ring_attention":
        return lambda q, k, v: ring_attention(q, k, v, plan.axes, causal=causal, scale=scale,
                                              layout="contiguous")
    return functools.partial(_dense, scale=scale, is_causal=causal)


def _plan(mesh, q_sharding, shapes, causal) -> AttentionPlan:
    q, k, v = shapes[:3]
    return plan_attention(dim_axes(q_sharding, 4, mesh), q.shape, k.shape, v.shape,
                          dict(mesh.shape), causal)


@functools.lru_cache(maxsize=None)
def _op(causal: bool, scale: float, same_heads: bool, same_len: bool, vjp: bool,
        explicit_out=None) -> custom_partitioning:
    """Forward op f(q, k, v) -> out, or with vjp f(q, k, v, g) -> (dq, dk, dv).
    Under explicit sharding `explicit_out` is the planned result spec(s)."""

    # The unpartitioned op: XLA's attention (its vjp), what every plan must equal.
    attend = functools.partial(_dense, scale=scale, is_causal=causal)
    if vjp:
        def fun(q, k, v, g):
            return jax.vjp(attend, q, k, v)[1](g)
    else:
        def fun(q, k, v):
            return attend(q, k, v)
    op = custom_partitioning(fun if explicit_out is None else replicated_fun(fun, explicit_out))

    def shardings(mesh, plan):
        q, kv, out = named(mesh, plan.q), named(mesh, plan.kv), named(mesh, plan.out)
        return ((q, kv, kv, out), (q, kv, kv)) if vjp else ((q, kv, kv), out)

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(mesh, arg_shapes[0].sharding, arg_shapes, causal)
        ins, outs = shardings(mesh, plan)
        record(Route("attention_vjp" if vjp else "attention", plan.route, plan.axes,
                     tuple(s.spec for s in ins),
                     tuple(s.spec for s in outs) if vjp else (outs.spec,)))
        local = _local(plan, causal, scale)
        if vjp:
            q_seq = plan.q[1] if plan.route == "attention" else ()

            def lower(q, k, v, g):
                dq, dk, dv = jax.vjp(local, q, k, v)[1](g)
                if q_seq:  # every query block adds to the gradient of the (whole) keys
                    dk, dv = lax.psum((dk, dv), q_seq)
                return dq, dk, dv
        else:
            lower = local
        return mesh, lower, outs, ins

    def infer(mesh, arg_shapes, result_shape):  # GSPMD propagation
        return shardings(mesh, _plan(mesh, arg_shapes[0].sharding, arg_shapes, causal))[1]

    op.def_partition(partition, infer_sharding_from_operands=infer,
                     propagate_user_sharding=lambda mesh, user_shape: jax.tree.map(
                         lambda s: s.sharding, user_shape),
                     sharding_rule=_rule(same_heads, same_len, vjp))
    return op


def _call(key, vjp: bool, *args):
    """The forward (q, k, v) or vjp (q, k, v, g) op. Under explicit sharding
    the route is planned here from q's type (the partition callback plans
    the same) and the gradients are resharded to their primals' shardings."""
    mesh = explicit_mesh(*args)
    if mesh is None:
        return _op(*key, vjp)(*args)
    plan = _plan(mesh, type_sharding(args[0]), args, key[0])
    if not vjp:
        return _op(*key, vjp, spec(plan.out))(*args)
    grads = _op(*key, vjp, (spec(plan.q), spec(plan.kv), spec(plan.kv)))(*args)
    return tuple(reshard(g, mesh, type_sharding(a).spec) for g, a in zip(grads, args))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, key):
    return _call(key, False, q, k, v)


def _attention_fwd(q, k, v, key):
    return _attention(q, k, v, key), (q, k, v)


def _attention_bwd(key, res, g):
    return tuple(_call(key, True, *res, g.astype(res[0].dtype)))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check(q, k, v) -> None:
    check_qkv_arrays("dot_product_attention", "seq", q, k, v)
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"pk_jax.dot_product_attention: expected q [B, S, Hq, D], k "
                         f"[B, T, Hkv, D] and v [B, T, Hkv, Dv], got q {q.shape}, k {k.shape} "
                         f"and v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"pk_jax.dot_product_attention: query heads ({q.shape[2]}) must be "
                         f"a multiple of kv heads ({k.shape[2]})")


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                          scale: Optional[float] = None) -> jax.Array:
    """`jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)`,
    partitioned by pk_jax under `jax.jit`.

    When q's sequence dim is sharded over mesh axes A and k/v have as many
    tokens, each device runs `pk_jax.ring_attention` over A on its contiguous
    block of the sequence (k and v are resharded to q's layout first if they
    differ); otherwise plain attention runs per device with the keys
    unsharded (batch and head sharding are kept in both cases; see
    `pk_jax/partitioning/_attention_plan.py`). Without a multi-device mesh
    it is plain attention. Values may have their own head dim Dv (which
    jax.nn.dot_product_attention does not take): that call runs the
    pure-lax attention per device (fp32 scores and softmax), never the
    ring. An empty head dim gives the empty result, as jax.nn does.

    Args:
      q: [B, S, Hq, D] queries, floating point.
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv (GQA / MQA).
      v: [B, T, Hkv, Dv] values.
      causal: mask keys at later positions than the query (aligned at 0, as
        in jax.nn.dot_product_attention); a bool.
      scale: score scale; None: 1 / sqrt(D).

    Returns:
      [B, S, Hq, Dv] in q's dtype. Differentiable (first order).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check(q, k, v)
    causal = _args.boolean("dot_product_attention", "causal", causal)
    scale = check_scale("dot_product_attention", scale, q.shape[3])
    key = (causal, scale, q.shape[2] == k.shape[2], q.shape[1] == k.shape[1])
    return _attention(q, k, v, key)
