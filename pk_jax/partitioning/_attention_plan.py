"""Routing of a sharded dot_product_attention ([B, S, H, D] layout): ring
attention when the sequence is sharded, plain attention otherwise. Pure
Python over per-dim mesh axes.

Rules (q's sharding leads; k and v are resharded to match it):
  * batch: q's axes for q, k, v and the output;
  * heads: q's axes when they also divide the kv heads (GQA keeps query head
    h with kv head h // (Hq / Hkv)), else unsharded;
  * head_dim: never sharded;
  * sequence sharded over axes A on q, as many keys as queries and k, v of
    one shape:
    `ring_attention` over A ("ring_attention"; k and v sharded over A too,
    contiguous layout). Otherwise "attention" with the keys unsharded and
    the queries keeping A unless causal (a causal mask needs global
    positions, so causal queries are gathered).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pk_jax.partitioning._specs import Axes, axes_size


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The route, the ring's axes, and per-dim axes of q, k, v and the output."""

    route: str
    axes: Axes
    q: tuple[Axes, ...]
    kv: tuple[Axes, ...]

    @property
    def out(self) -> tuple[Axes, ...]:
        return self.q


def plan_attention(q: Sequence[Axes], q_shape: Sequence[int], k_shape: Sequence[int],
                   v_shape: Sequence[int], sizes: dict, causal: bool) -> AttentionPlan:
    """Route one attention call from q's per-dim mesh axes and the shapes
    (the ring also needs v's head_dim equal to k's)."""
    batch, seq, heads = tuple(q[0]), tuple(q[1]), tuple(q[2])
    n_heads = axes_size(sizes, heads)
    if k_shape[2] % n_heads or q_shape[2] % n_heads:
        heads = ()
    if seq and q_shape[1] == k_shape[1] and tuple(k_shape) == tuple(v_shape):
        return AttentionPlan("ring_attention", seq, (batch, seq, heads, ()),
                             (batch, seq, heads, ()))
    q_seq = () if causal else seq
    return AttentionPlan("attention", (), (batch, q_seq, heads, ()), (batch, (), heads, ()))
