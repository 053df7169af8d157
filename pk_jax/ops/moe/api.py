"""pk_jax.moe_dispatch / pk_jax.moe_combine: expert-parallel token exchange.

Inside `jax.shard_map` over an expert axis of n devices, each holding
`num_experts // n` consecutive experts (global expert e lives on rank
`e // experts_per_rank` as its local expert `e % experts_per_rank`):

    rows, layout = pk_jax.moe_dispatch(x, expert_ids, axis_name="ep",
                                       num_experts=E)
    h = expert_mlp(rows, layout.group_sizes)          # e.g. lax.ragged_dot
    out = pk_jax.moe_combine(h, weights, layout)      # [T, H], token order

Layout of `rows` on the receiving rank (static size `layout.num_rows`):
grouped by local expert; inside an expert, by source rank; inside a source,
by slot order (token t, then choice j). `layout.group_sizes[l]` rows belong
to local expert l, so `rows` feeds `jax.lax.ragged_dot` directly; the rows
past `sum(group_sizes)` are zeros (padding) and are ignored by combine.

Static bound: drop-less (capacity=None) means the worst case, every slot of
every rank of the axis choosing this rank: `num_rows = n * T * k`. With
`capacity=c`, every local expert keeps at most c rows (`num_rows =
experts_per_rank * c`; a capacity above the drop-less bound n * T * k
drops nothing and is clamped to it); the rows an expert keeps are the first c in the
order above (lower source ranks first, then token order), the others are
dropped: they contribute nothing to combine's output and are counted in
`layout.num_dropped` (this rank's slots that were dropped).

Data-dependent bad input is never a wrong row: an expert id outside
[0, num_experts) drops its slot (no row anywhere, no contribution to the
output) and is counted in `layout.num_invalid`. Everything static (shapes,
dtypes, k > num_experts, experts not divisible by n) raises a ValueError.

The ragged sizes are exchanged on the device (an all-gather of the n x E
count matrix inside the program): no host synchronization.

Gradients: the exchange `slots -> rows` and the return `rows -> slots` are
linear and each other's transposes (custom_vjp pairs them), so moe_dispatch's
backward runs combine's exchange and moe_combine's backward runs dispatch's.
combine's output is differentiable in the router weights.

Mechanisms ("auto": pk_jax/tuning.py: on one device "local", where nothing
crosses devices: the layout computed by one kernel (`pk_moe_layout`, one
thread block, up to primitive.LAYOUT_MAX_SLOTS slots and
LAYOUT_MAX_EXPERTS experts; beyond, XLA's ops), dispatch's rows written
from their tokens by one kernel (`pk_moe_scatter_rows`, each token read
once for its k rows) and combine's weighted sum of each token's rows read
where they lie by another (`pk_moe_weighted_sum`, no [T * k, H]
intermediate), the two each other's transposes; else "ld_st", falling back
to "xla"'s dense exchange, with a one-time warning, on an axis where the
kernel cannot run):
  "ld_st": pk's kernel (xla_ffi/moe.cc, csrc/kernels/moe/): dispatch
    stores each slot's token row into its destination rank's staging region
    (straight into the output when it stays on this rank), posts a flag per
    peer, waits (bounded) for every peer's flag and drains its region into
    the output; combine stages the rows each rank owes others in its own
    region and every slot pulls its row. Works across processes of one host
    (staging through the shared workspaces). Where the kernel cannot run it
    raises (forced mechanism); on other platforms the primitive lowers to a
    dense all_to_all.
  "ragged": `jax.lax.ragged_all_to_all` of each peer's rows (contiguous,
    sorted by local expert) into a staging buffer of num_rows rows, then one
    local gather into the (expert, source) order; XLA:CPU has no
    ragged-all-to-all (jax 0.10), so on CPU this lowers to the "xla"
    exchange (`lax.platform_dependent`), with identical results.
  "xla": a dense `lax.all_to_all` of per-pair blocks bounded by
    min(T * k, num_rows) rows (n times the ragged traffic at worst), then
    gathers; runs everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import groups, tuning
from pk_jax._args import INT32_MAX
from pk_jax._compat import make_varying
from pk_jax.ops.all_gather import all_gather as _pk_all_gather
from pk_jax.ops.moe.primitive import (ExchangeConfig, counts_and_ranks, expand_mask,
                                      exclusive_cumsum, kept_rows, local_layout, moe_exchange_p,
                                      scatter_rows, slot_keys, slot_rows, slot_tallies,
                                      weighted_slots, weighted_sum)

MECHANISMS = ("auto", "ld_st", "ragged", "xla")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Everything static about one dispatch/combine pair."""
    axis_names: tuple[str, ...]
    axis_size: int          # n: ranks of the expert axis
    num_experts: int        # E, global
    tokens: int             # T, tokens of each rank
    top_k: int              # k, choices per token
    capacity: int | None    # rows kept per local expert, None: drop-less
    mechanism: str          # "ld_st", "ragged", "xla" or "local" (auto on one device)
    forced: bool = True     # the user named the mechanism (an error where it cannot run)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.axis_size

    @property
    def slots(self) -> int:
        return self.tokens * self.top_k

    @property
    def num_rows(self) -> int:
        """Static bound on the rows a rank receives."""
        if self.capacity is None:
            return self.axis_size * self.slots
        return self.experts_per_rank * self.capacity

    @property
    def pair_rows(self) -> int:
        """Static bound on the rows one rank sends one other rank."""
        return min(self.slots, self.num_rows)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("group_sizes", "src_rank", "src_slot", "dest_rank", "dest_row",
                                "num_dropped", "num_invalid", "send_counts", "recv_counts",
                                "peer_offsets", "return_offsets", "send_index", "recv_index"),
                   meta_fields=("cfg",))
@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """What moe_dispatch computed and moe_combine needs (a pytree of int32
    arrays, all per rank, plus the static config).

    Attributes:
      group_sizes: [experts_per_rank] rows of each local expert, in order
        (`jax.lax.ragged_dot`'s group_sizes; their sum is at most num_rows).
      src_rank: [num_rows] the rank each row came from, -1 on padding rows.
      src_slot: [num_rows] its slot on that rank, `token * k + choice`, -1 on
        padding rows (token = src_slot // k).
      dest_rank: [T, k] the rank each of this rank's slots went to, -1 for an
        out-of-range expert id.
      dest_row: [T, k] its row there, -1 if it was dropped (capacity) or
        invalid.
      num_dropped: [] this rank's slots dropped by the capacity.
      num_invalid: [] this rank's slots with an expert id out of range.
      send_counts: [n] rows this rank sends each rank.
      recv_counts: [n] rows this rank receives from each rank.
      peer_offsets: [n] where this rank's rows start in each receiver's
        staging buffer (ragged exchange: receivers stage rows by source).
      return_offsets: [n] where each receiver's returned rows start in this
        rank's send buffer (combine's ragged exchange).
      send_index, recv_index: a row's position inside its (source,
        destination) block, ordered by local expert ([T * k] and
        [num_rows], -1 where unused).
    """
    group_sizes: jax.Array
    src_rank: jax.Array
    src_slot: jax.Array
    dest_rank: jax.Array
    dest_row: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    send_counts: jax.Array
    recv_counts: jax.Array
    peer_offsets: jax.Array
    return_offsets: jax.Array
    send_index: jax.Array
    recv_index: jax.Array
    cfg: MoeConfig

    @property
    def num_rows(self) -> int:
        return self.cfg.num_rows


# ---- validation ------------------------------------------------------------------
def _int(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"pk_jax.moe_dispatch: {name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _config(x, expert_ids, names, num_experts, capacity, mechanism) -> MoeConfig:
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.moe_dispatch: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"pk_jax.moe_dispatch: x must be [tokens, hidden] with hidden >= 1, "
                         f"got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"pk_jax.moe_dispatch: x must be floating point, got {x.dtype}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"pk_jax.moe_dispatch: expert_ids must be [tokens, k] with tokens = "
                         f"{x.shape[0]} (x's rows), got shape {expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"pk_jax.moe_dispatch: expert_ids must be integers, got "
                         f"{expert_ids.dtype}")
    n = lax.axis_size(names)
    e = _int("num_experts", num_experts, 1)
    if e > INT32_MAX:
        raise ValueError(f"pk_jax.moe_dispatch: num_experts={e} must be below 2^31 (expert "
                         "ids and counts are int32 on the device)")
    if e % n:
        raise ValueError(f"pk_jax.moe_dispatch: num_experts={e} must be a multiple of the {n} "
                         f"devices of {names} (each holds num_experts / {n} experts)")
    t, k = expert_ids.shape
    if not 1 <= k <= e:
        raise ValueError(f"pk_jax.moe_dispatch: top-k = {k} (expert_ids.shape[1]) must be in "
                         f"1..num_experts={e}")
    dropless = n * t * k  # every slot of every rank of the axis on one expert
    if dropless > INT32_MAX:
        raise ValueError(f"pk_jax.moe_dispatch: {n} ranks x {t} tokens x top-{k} = {dropless} "
                         "slots: row indices are int32 on the device, so at most 2^31 - 1")
    cap = None if capacity is None else min(_int("capacity", capacity, 1), dropless)
    if cap is not None and (e // n) * cap > INT32_MAX:
        raise ValueError(f"pk_jax.moe_dispatch: capacity={capacity} gives {e // n} local "
                         f"experts x {cap} = {(e // n) * cap} rows per rank: row indices are "
                         "int32 on the device, so at most 2^31 - 1; lower the capacity")
    return MoeConfig(names, n, e, t, k, cap,
                     tuning.moe_mechanism(n) if mechanism == "auto" else mechanism,
                     forced=mechanism != "auto")


# ---- routing metadata (on the device; no host sync) --------------------------------
def segment_of(positions: jax.Array, ends: jax.Array) -> jax.Array:
    """The segment each of `positions` falls in, given the segments' ends
    (their inclusive cumulative sizes, `jnp.cumsum(sizes)`): how many
    segments end at or before it, `len(ends)` past the last one. The value
    of `jnp.searchsorted(ends, positions, side="right")` as one fused compare
    over the segments (searchsorted's while loop runs on the host)."""
    return jnp.sum(positions[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _local_layout(expert_ids: jax.Array, cfg: MoeConfig) -> MoeLayout:
    """The layout on an axis of one device (mechanism "local"): the slots'
    rows, the rows' slots, the group sizes and the tallies from the layout
    primitive (one kernel on CUDA within its bounds, primitive.py); the
    exchanges' fields follow from them, as _layout's formulas give them for
    n = 1 (one source and destination; the kept rows are [0, sum(group_sizes))
    exactly, so a row is used where it has a slot)."""
    dest_row, src_slot, group_sizes, dropped, invalid = local_layout(
        expert_ids, cfg.num_experts, cfg.capacity, cfg.num_rows)
    valid = slot_keys(expert_ids.reshape(cfg.slots), cfg.num_experts)[0]
    used = src_slot >= 0
    rank = lambda mask: jnp.where(mask, jnp.int32(0), jnp.int32(-1))  # rank 0, or none
    rows = group_sizes.sum(dtype=jnp.int32)[None]                     # [1]: this rank to itself
    start = jnp.zeros((1,), jnp.int32)
    return MoeLayout(group_sizes, rank(used), src_slot,
                     rank(valid).reshape(cfg.tokens, cfg.top_k),
                     dest_row.reshape(cfg.tokens, cfg.top_k), dropped, invalid, rows, rows,
                     start, start, dest_row,
                     jnp.where(used, jnp.arange(cfg.num_rows, dtype=jnp.int32), -1), cfg)


def _layout(expert_ids: jax.Array, cfg: MoeConfig) -> MoeLayout:
    if cfg.mechanism == "local":  # one device: every kept slot's row is here
        return _local_layout(expert_ids, cfg)
    n, e, el, s = cfg.axis_size, cfg.num_experts, cfg.experts_per_rank, cfg.slots
    names = cfg.axis_names
    me = lax.axis_index(names)
    valid, ids, key = slot_keys(expert_ids.reshape(s), e)
    counts, q = counts_and_ranks(key, e)
    counts = counts[:e]                                               # [E]
    # The n x n x E_local count matrix, on every rank: C[src, dst, local expert].
    # pk's gather with the pk kernel (no XLA collective: runs across processes sharing a GPU).
    gather = _pk_all_gather if cfg.mechanism == "ld_st" else lax.all_gather
    table = (counts.reshape(1, 1, el) if n == 1 else
             gather(counts.reshape(n, el), names))                    # [n, n, el]
    kept = kept_rows(table, cfg.capacity)                             # earlier sources first
    dest = jnp.where(valid, ids // el, 0)
    local = jnp.where(valid, ids % el, 0)
    kept_mine = kept[me]                                              # [dst, el]
    keep = valid & (q < kept_mine[dest, local])
    # Row at the receiver: its earlier experts, this expert's earlier sources, q.
    expert_base = exclusive_cumsum(kept.sum(0, dtype=jnp.int32), 1)  # [dst, el]
    source_base = exclusive_cumsum(kept, 0)[me]                       # [dst, el]
    dest_row = jnp.where(keep, expert_base[dest, local] + source_base[dest, local] + q, -1)
    # Position in the per-pair block of the xla exchange: (local expert, q).
    send_index = jnp.where(keep, exclusive_cumsum(kept_mine, 1)[dest, local] + q, -1)

    # Receiver side: rows in (local expert, source, q) order.
    mine = kept[:, me, :]                                             # [src, el]
    group_sizes = mine.sum(0, dtype=jnp.int32)                        # int32 with x64 too
    block = mine.T.reshape(el * n)                                    # (l, s) blocks
    block_end = jnp.cumsum(block)
    p = jnp.arange(cfg.num_rows, dtype=jnp.int32)
    b = segment_of(p, block_end)
    used = p < block_end[-1]
    b = jnp.minimum(b, el * n - 1)
    l_of, s_of = b // n, b % n
    q_of = p - (block_end[b] - block[b])
    recv_index = jnp.where(used, exclusive_cumsum(kept[:, me, :], 1)[s_of, l_of] + q_of, -1)
    src_rank = jnp.where(used, s_of, -1)
    dropped, invalid = slot_tallies(valid, keep)
    pair = kept.sum(2, dtype=jnp.int32)                               # [src, dst] rows
    lay = MoeLayout(group_sizes, src_rank, jnp.zeros_like(src_rank),
                    jnp.where(valid, dest, -1).reshape(cfg.tokens, cfg.top_k),
                    dest_row.reshape(cfg.tokens, cfg.top_k), dropped, invalid,
                    pair[me], pair[:, me], exclusive_cumsum(pair, 0)[me],
                    exclusive_cumsum(pair, 1)[:, me], send_index, recv_index, cfg)
    # Source slots travel with the rows (the receiver cannot derive them).
    slot_ids = jnp.arange(1, s + 1, dtype=jnp.int32)[:, None]
    src_slot = _exchange(slot_ids, lay, to_rows=True)[:, 0] - 1
    return dataclasses.replace(lay, src_slot=src_slot)


# ---- the exchange: slots -> rows and its transpose rows -> slots -------------------
def _axis(cfg: MoeConfig):
    names = cfg.axis_names
    return names[0] if len(names) == 1 else names


def _a2a(buf: jax.Array, cfg: MoeConfig) -> jax.Array:
    return lax.all_to_all(buf, _axis(cfg), 0, 0)


class _Side(NamedTuple):
    """One end of the exchange, per row of its array: the peer rank it goes
    to (or came from), its index in that (source, destination) block (-1:
    none), and per peer the rows of their block. The slots' side is
    (dest_rank, send_index, send_counts), the rows' (src_rank, recv_index,
    recv_counts); the backward exchange is the forward one with the sides
    swapped."""

    peer: jax.Array
    index: jax.Array
    counts: jax.Array


def _exchange(x: jax.Array, lay: MoeLayout, to_rows: bool, repeat: int = 1) -> jax.Array:
    """to_rows: slots [T*k, H] (or tokens [T*k / repeat, H], slot i carrying
    row i // repeat) -> rows [num_rows, H] (zeros where nothing landed);
    else rows -> slots (zeros for dropped and invalid slots)."""
    cfg = lay.cfg
    if cfg.mechanism == "ld_st":
        return _kernel_exchange(x, lay, to_rows, repeat)
    if repeat > 1:
        x = jnp.repeat(x, repeat, axis=0)
    slots = _Side(lay.dest_rank.reshape(-1), lay.send_index, lay.send_counts)
    rows = _Side(lay.src_rank, lay.recv_index, lay.recv_counts)
    src, dst, offsets = ((slots, rows, lay.peer_offsets) if to_rows
                         else (rows, slots, lay.return_offsets))
    if cfg.mechanism == "ragged":
        return lax.platform_dependent(x, src, dst, offsets,
                                      cpu=functools.partial(_dense_move, cfg=cfg),
                                      default=functools.partial(_ragged_move, cfg=cfg))
    return _dense_move(x, src, dst, offsets, cfg=cfg)


def _kernel_exchange(x: jax.Array, lay: MoeLayout, to_rows: bool, repeat: int) -> jax.Array:
    """pk's exchange primitive (primitive.py), routed by the slots' (rank,
    row) and the rows' source rank alone."""
    cfg = lay.cfg
    row = lay.dest_row.reshape(-1)
    peer = jnp.where(row >= 0, lay.dest_rank.reshape(-1), -1)
    args = [make_varying(a, cfg.axis_names) for a in (x, peer, row, lay.src_rank)]
    return moe_exchange_p.bind(*args, cfg=ExchangeConfig(cfg.axis_names, cfg.axis_size,
                                                         to_slots=not to_rows, repeat=repeat,
                                                         forced=cfg.forced))


def _ragged_move(x: jax.Array, src: _Side, dst: _Side, offsets: jax.Array, *,
                 cfg: MoeConfig) -> jax.Array:
    """The exchange with lax.ragged_all_to_all: x's rows packed by peer, one
    ragged exchange (`offsets`: where this rank's block lands on each peer),
    then dst's rows picked out of the received blocks."""
    sent = src.index >= 0
    send_start = exclusive_cumsum(src.counts, 0)
    pos = jnp.where(sent, send_start[jnp.where(sent, src.peer, 0)] + src.index,
                    x.shape[0])                                      # out of bounds: dropped
    send = jnp.zeros_like(x).at[pos].set(x, mode="drop")
    staging = make_varying(jnp.zeros(dst.peer.shape + x.shape[1:], x.dtype), cfg.axis_names)
    staging = lax.ragged_all_to_all(make_varying(send, cfg.axis_names), staging, send_start,
                                    src.counts, offsets, dst.counts, axis_name=_axis(cfg))
    got = dst.index >= 0
    recv_start = exclusive_cumsum(dst.counts, 0)
    out = staging[jnp.where(got, recv_start[jnp.where(got, dst.peer, 0)] + dst.index, 0)]
    return jnp.where(expand_mask(got, out), out, 0)


def _dense_move(x: jax.Array, src: _Side, dst: _Side, offsets: jax.Array, *,
                cfg: MoeConfig) -> jax.Array:
    """The exchange with a padded lax.all_to_all ([n, pair_rows] blocks)."""
    del offsets  # every block starts at 0
    n, b = cfg.axis_size, cfg.pair_rows
    sent = src.index >= 0
    buf = jnp.zeros((n, b) + x.shape[1:], x.dtype)
    buf = buf.at[jnp.where(sent, src.peer, n),                         # n: out of bounds
                 jnp.where(sent, src.index, 0)].set(x, mode="drop")
    recv = _a2a(make_varying(buf, cfg.axis_names), cfg)
    got = dst.index >= 0
    out = recv[jnp.where(got, dst.peer, 0), jnp.where(got, dst.index, 0)]
    return jnp.where(expand_mask(got, out), out, 0)


def _tokens_to_rows(x: jax.Array, lay: MoeLayout) -> jax.Array:
    if lay.cfg.mechanism == "local":  # each token read once, written to its slots' rows
        return scatter_rows(x, lay.dest_row.reshape(-1), lay.src_slot, repeat=lay.cfg.top_k)
    return _exchange(x, lay, to_rows=True, repeat=lay.cfg.top_k)


def _rows_to_tokens_sum(dy: jax.Array, lay: MoeLayout) -> jax.Array:
    """The transpose of _tokens_to_rows: each token's k slots summed (fp32)."""
    cfg = lay.cfg
    if cfg.mechanism == "local":  # each token's rows, summed where they lie
        return weighted_sum(dy, lay.dest_row.reshape(-1), None, cfg.tokens)
    slots = _exchange(dy, lay, to_rows=False)
    return slots.reshape(cfg.tokens, cfg.top_k, -1).astype(jnp.float32).sum(1).astype(dy.dtype)


def _transposed_pair(forward: Callable, backward: Callable) -> Callable:
    """f(x, lay) = forward(x, lay), a linear exchange whose gradient is the
    exchange the other way: backward(dy, lay) (the layout has none)."""

    @jax.custom_vjp
    def f(x, lay):
        return forward(x, lay)

    f.defvjp(lambda x, lay: (forward(x, lay), lay), lambda lay, dy: (backward(dy, lay), None))
    return f


_to_experts = _transposed_pair(_tokens_to_rows, _rows_to_tokens_sum)      # tokens -> rows
_from_experts = _transposed_pair(functools.partial(_exchange, to_rows=False),
                                 functools.partial(_exchange, to_rows=True))  # rows -> slots


@jax.custom_vjp
def _combine_local(y: jax.Array, weights: jax.Array, lay: MoeLayout) -> jax.Array:
    """moe_combine on an axis of one device: each token's k rows read where
    they lie and summed, weighted (one weighted_sum); the gradients are y's
    rows written from their tokens times their slot's weight and, for the
    weights, the transpose of the weighted sum on the slots' rows."""
    return weighted_sum(y, lay.dest_row.reshape(-1), weights.reshape(-1), lay.cfg.tokens)


def _combine_local_fwd(y, weights, lay):
    return _combine_local(y, weights, lay), (y, weights, lay)


def _combine_local_bwd(res, dout):
    y, weights, lay = res
    cfg = lay.cfg
    row = lay.dest_row.reshape(-1)
    dy = scatter_rows(dout, row, lay.src_slot, repeat=cfg.top_k,
                      scale=weights.astype(jnp.float32).reshape(-1))
    slots = slot_rows(y, row, cfg.tokens)
    _, weights_vjp = jax.vjp(lambda w: weighted_slots(w, slots), weights.astype(jnp.float32))
    dw, = weights_vjp(dout.astype(jnp.float32))
    return dy, dw.astype(weights.dtype), None


_combine_local.defvjp(_combine_local_fwd, _combine_local_bwd)


# ---- public API ------------------------------------------------------------------
def moe_dispatch(x: jax.Array, expert_ids: jax.Array, axis_name: str | Sequence[str], *,
                 num_experts: int, capacity: int | None = None,
                 mechanism: str = "auto") -> tuple[jax.Array, MoeLayout]:
    """Send every token to the ranks of its top-k experts, grouped by local expert.

    Call inside `jax.shard_map` over `axis_name` (the expert axis, n devices;
    device r holds experts [r * E / n, (r + 1) * E / n)).

    Args:
      x: [T, H] this rank's tokens, floating point.
      expert_ids: [T, k] integer global expert ids of each token's choices
        (e.g. `lax.top_k(router_logits, k)[1]`); 1 <= k <= num_experts. An id
        outside [0, num_experts) drops that choice (counted in
        `layout.num_invalid`). Duplicate ids in a row are separate rows.
      axis_name: the expert mesh axis (or tuple of axes, row-major).
      num_experts: E, a multiple of n.
      capacity: None (drop-less: `num_rows = n * T * k`, the worst case) or
        the rows each local expert keeps (`num_rows = (E / n) * capacity`;
        the rest are dropped and counted in `layout.num_dropped`). A
        capacity above n * T * k drops nothing and is clamped to it. Row
        indices are int32: n * T * k and (E / n) * capacity (after the
        clamp) must stay below 2^31 (a ValueError otherwise).
      mechanism: "auto" (on one device one gather each way; else "ld_st"
        where the kernel can run, else the dense exchange), "ld_st" (pk's
        kernel; an error where it cannot run), "ragged" or "xla" (see the
        module docstring).

    Returns:
      (rows, layout): rows [layout.num_rows, H] in x's dtype, grouped by
      local expert (`layout.group_sizes`), zero padded; `layout` is a
      `MoeLayout` for `moe_combine` (and for inspection).
    """
    names = groups.axis_names(axis_name, "moe_dispatch")
    x = jnp.asarray(x)
    expert_ids = jnp.asarray(expert_ids)
    cfg = _config(x, expert_ids, names, num_experts, capacity, mechanism)
    lay = _layout(expert_ids, cfg)
    return _to_experts(x, lay), lay                                   # slot t*k+j: token t


def moe_combine(y: jax.Array, weights: jax.Array, layout: MoeLayout) -> jax.Array:
    """Return expert outputs to their tokens and sum them, weighted.

    `out[t] = sum_j weights[t, j] * y_row(t, j)` where y_row(t, j) is the
    row that moe_dispatch made of token t's j-th choice (zero when it was
    dropped or invalid). Call inside the same shard_map as moe_dispatch.

    Args:
      y: [layout.num_rows, H'] expert outputs, in dispatch's row layout
        (padding rows are ignored), floating point.
      weights: [T, k] router weights, floating point (accumulation is fp32).
      layout: moe_dispatch's layout.

    Returns:
      [T, H'] in y's dtype, in this rank's token order.
    """
    if not isinstance(layout, MoeLayout):
        raise ValueError(f"pk_jax.moe_combine: layout must be moe_dispatch's MoeLayout, got "
                         f"{type(layout).__name__}")
    cfg = layout.cfg
    y, weights = jnp.asarray(y), jnp.asarray(weights)
    if y.ndim != 2 or y.shape[0] != cfg.num_rows:
        raise ValueError(f"pk_jax.moe_combine: y must be [num_rows={cfg.num_rows}, features], "
                         f"got shape {y.shape}")
    if weights.shape != (cfg.tokens, cfg.top_k):
        raise ValueError(f"pk_jax.moe_combine: weights must be [T, k] = "
                         f"{(cfg.tokens, cfg.top_k)}, got shape {weights.shape}")
    for what, a in (("y", y), ("weights", weights)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"pk_jax.moe_combine: {what} must be floating point, got {a.dtype}")
    if cfg.mechanism == "local":
        return _combine_local(y, weights, layout)
    slots = _from_experts(y, layout).reshape(cfg.tokens, cfg.top_k, y.shape[1])
    return weighted_slots(weights, slots).astype(y.dtype)
