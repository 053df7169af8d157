"""The primitives of the MoE token exchange (pk_jax.moe_dispatch /
moe_combine): pk's exchange kernel (mechanism "ld_st") and, on an expert
axis of one device, the two row movements of the layout.

`pk_moe_exchange`: (src, slot_peer [S] int32, slot_row [S] int32, row_src
[R] int32) -> out. The routing, in slot terms: slot i has its row on rank
slot_peer[i], row slot_row[i] there (none when slot_peer[i] < 0 or the row
is outside [0, R)); row p of this rank came from rank row_src[p] (-1:
padding). Two directions (`ExchangeConfig.to_slots`):
  * slots -> rows (dispatch): src [S / repeat, ...] (slot i carries src row
    i // repeat: dispatch passes the tokens and repeat = k, so the k copies
    of a token are never materialized) -> out [R, ...], zeros on padding;
  * rows -> slots (combine): src [R, ...] -> out [S, ...], zeros for slots
    without a row.
The routing arrays stay on the device. Dispatch and combine are the two
directions; pk_jax/ops/moe/api.py pairs them as each other's transposes
(custom_vjp), so the primitive has no AD rules. Lowering: on CUDA with the
extension built, the FFI kernel of xla_ffi/moe.cc; elsewhere (and where the
kernel cannot run on the axis under "auto") a dense `lax.all_to_all` of
[n, R] blocks.

On one device (no collective; api.py pairs them in its custom_vjps):
  * `pk_moe_scatter_rows`: (src [S, H], dest [S * repeat] int32, row_slot
    [R] int32, scale [S * repeat] float32 or [0]) -> [R, H]: row r = scale[i]
    * src[i // repeat] for its slot i = row_slot[r], zeros where i is outside
    [0, S * repeat); the kernel writes each src row to its slots' rows
    (dest, the inverse of row_slot), reading it once (dispatch's rows;
    combine's input gradient, scaled by each slot's weight);
  * `pk_moe_weighted_sum`: (src [R, H], index [T * k] int32, weight [T * k]
    float32 or [0]) -> [T, H]: row t = the sum over j of weight[t * k + j] *
    src[index[t * k + j]] in fp32, rows outside [0, R) left out (combine;
    dispatch's input gradient, unweighted).
  * `pk_moe_layout`: (expert_ids [S] int32 or int64) -> (dest_row [S],
    src_slot [R], group_sizes [E], num_dropped [], num_invalid []), all
    int32: the layout of those rows (`local_layout`; slot i = token * k +
    choice; a valid id is in [0, E); an expert's rows are its first
    `capacity` slots in slot order, grouped by expert).
All three lower to their FFI kernels on CUDA with the extension built,
elsewhere to the same arithmetic in XLA (bit for bit what the other
exchanges give on CPU). The layout's kernel is one thread block; calls
beyond its bounds (more than LAYOUT_MAX_SLOTS slots, LAYOUT_MAX_EXPERTS
experts or LAYOUT_MAX_ROWS rows, ids other than int32 / int64 after a
lossless widening) lower to the XLA layout on CUDA too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pk_jax._compat import result_aval
from pk_jax.ops._lowering import channel_attr, def_eager_impl, kernel_group, kernels_missing


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """Static part of one exchange: the axes, their size, the direction,
    slots per source row (slots -> rows), whether the user forced the kernel
    (mechanism="ld_st": an error where it cannot run)."""
    names: tuple[str, ...]
    n: int
    to_slots: bool
    repeat: int = 1
    forced: bool = True


moe_exchange_p = Primitive("pk_moe_exchange")


def _abstract_eval(src, slot_peer, slot_row, row_src, *, cfg: ExchangeConfig):
    rows = slot_peer.shape[0] if cfg.to_slots else row_src.shape[0]
    return result_aval(src, (rows,) + src.shape[1:])


def expand_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
    """`mask` with trailing unit axes, to broadcast against `like` in jnp.where."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def reference_exchange(src, slot_peer, slot_row, row_src, cfg: ExchangeConfig):
    """The exchange's semantics with XLA collectives (dense: n x R rows a rank)."""
    n, rows = cfg.n, row_src.shape[0]
    axis = cfg.names[0] if len(cfg.names) == 1 else cfg.names
    ok = (slot_peer >= 0) & (slot_peer < n) & (slot_row >= 0) & (slot_row < rows)
    has_src = (row_src >= 0) & (row_src < n)
    src_of = jnp.where(has_src, row_src, 0)
    if not cfg.to_slots:
        tokens = jnp.repeat(src, cfg.repeat, axis=0) if cfg.repeat > 1 else src
        buf = jnp.zeros((n, rows) + src.shape[1:], src.dtype)
        buf = buf.at[jnp.where(ok, slot_peer, n), jnp.where(ok, slot_row, 0)].set(
            tokens, mode="drop")
        got = lax.all_to_all(buf, axis, 0, 0)                      # [source, rows, ...]
        out = got[src_of, jnp.arange(rows)]
        return jnp.where(expand_mask(has_src, out), out, 0)
    # rows -> slots: every rank sends each peer the rows it owes that peer.
    owed = jnp.arange(n)[:, None] == jnp.where(has_src, row_src, -1)[None, :]     # [peer, rows]
    buf = jnp.where(expand_mask(owed, src[None]), src[None], 0)
    got = lax.all_to_all(buf, axis, 0, 0)                          # [row rank, rows, ...]
    out = got[jnp.where(ok, slot_peer, 0), jnp.where(ok, slot_row, 0)]
    return jnp.where(expand_mask(ok, out), out, 0)


def _reference_lowering(ctx, *args, cfg: ExchangeConfig):
    fn = lambda *a: reference_exchange(*a, cfg)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _cuda_lowering(ctx, src, slot_peer, slot_row, row_src, *, cfg: ExchangeConfig):
    table = kernel_group(ctx, "moe", cfg.names, cfg.n, forced="ld_st" if cfg.forced else None)
    if table is None:
        return _reference_lowering(ctx, src, slot_peer, slot_row, row_src, cfg=cfg)
    src_aval, _, _, row_src_aval = ctx.avals_in
    row_bytes = int(np.prod(src_aval.shape[1:], dtype=np.int64)) * \
        np.dtype(src_aval.dtype).itemsize
    attr = channel_attr(table, "moe", "exchange", row_src_aval.shape[0] * row_bytes)
    return jax.ffi.ffi_lowering("pk_moe_exchange")(
        ctx, src, slot_peer, slot_row, row_src, row_bytes=np.int64(row_bytes),
        to_slots=np.int32(cfg.to_slots), repeat=np.int64(cfg.repeat), **attr)


moe_exchange_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(moe_exchange_p, _reference_lowering)
mlir.register_lowering(moe_exchange_p, _cuda_lowering, platform="cuda")


# ---- one device: the rows gathered and summed ---------------------------------------
moe_scatter_rows_p = Primitive("pk_moe_scatter_rows")
moe_weighted_sum_p = Primitive("pk_moe_weighted_sum")


def _no_floats():
    return jnp.zeros((0,), jnp.float32)


def scatter_rows(src: jax.Array, dest: jax.Array, row_slot: jax.Array, repeat: int = 1,
                 scale: jax.Array | None = None) -> jax.Array:
    """[len(row_slot), H]: row r = scale[i] * src[i // repeat] for its slot
    i = row_slot[r] (zeros where i is out of range); src [S, H], dest [S *
    repeat] the row of each slot (row_slot's inverse), scale [S * repeat] or
    None."""
    scaled = scale is not None
    return moe_scatter_rows_p.bind(src, dest.astype(jnp.int32), row_slot.astype(jnp.int32),
                                   scale.astype(jnp.float32) if scaled else _no_floats(),
                                   repeat=int(repeat), scaled=scaled)


def weighted_sum(src: jax.Array, index: jax.Array, weight: jax.Array | None,
                 tokens: int) -> jax.Array:
    """[tokens, H]: row t = sum_j weight[t, j] * src[index[t, j]] (fp32,
    rows out of range left out; weight None: 1), in src's dtype; index and
    weight [tokens * k]."""
    weighted = weight is not None
    return moe_weighted_sum_p.bind(src, index.astype(jnp.int32),
                                   weight.astype(jnp.float32) if weighted else _no_floats(),
                                   tokens=int(tokens), weighted=weighted)


def _scatter_abstract(src, dest, row_slot, scale, *, repeat: int, scaled: bool):
    return result_aval(src, (row_slot.shape[0],) + src.shape[1:])


def _sum_abstract(src, index, weight, *, tokens: int, weighted: bool):
    return result_aval(src, (tokens,) + src.shape[1:])


def reference_scatter_rows(src, dest, row_slot, scale, *, repeat: int, scaled: bool):
    del dest  # the rows' slots say the same
    got = (row_slot >= 0) & (row_slot < src.shape[0] * repeat)
    i = jnp.where(got, row_slot, 0)
    out = src[i // repeat]
    if scaled:
        out = (out.astype(jnp.float32) * expand_mask(scale[i], out)).astype(src.dtype)
    return jnp.where(expand_mask(got, out), out, 0)


def slot_rows(src, index, tokens: int):
    """[tokens, k, ...] float32: src's row index[t * k + j] of every slot,
    zeros where the index is out of range."""
    got = (index >= 0) & (index < src.shape[0])
    rows = src[jnp.where(got, index, 0)]
    slots = jnp.where(expand_mask(got, rows), rows, 0).astype(jnp.float32)
    return slots.reshape((tokens, -1) + src.shape[1:])


def weighted_slots(weights, slots):
    """[T, k] weights and [T, k, H] slot rows -> [T, H], fp32."""
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), slots.astype(jnp.float32))


def reference_weighted_sum(src, index, weight, *, tokens: int, weighted: bool):
    slots = slot_rows(src, index, tokens)
    if not weighted:
        return slots.sum(1).astype(src.dtype)
    return weighted_slots(weight.reshape(tokens, -1), slots).astype(src.dtype)


# ---- one device: the layout ----------------------------------------------------------
moe_layout_p = Primitive("pk_moe_layout")
moe_layout_p.multiple_results = True

# The layout kernel's bounds (csrc/kernels/moe/moe.h kLayoutMax*: one block
# of 32 warps, each key's per-warp counts in shared memory, a slot's rank in
# its warp's segment in 16 bits); beyond them the XLA layout runs on CUDA too.
LAYOUT_MAX_SLOTS = 1 << 16
LAYOUT_MAX_EXPERTS = 255
LAYOUT_MAX_ROWS = 1 << 18
_LAYOUT_ID_TYPES = (np.dtype(np.int32), np.dtype(np.int64))   # the kernel's


def exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def slot_keys(raw: jax.Array, e: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(valid: 0 <= id < e, ids: int32 with 0 for invalid, key: the id, e when
    invalid) of the slots' ids [s] in any integer dtype, compared in their
    own dtype (an int64 id never wraps)."""
    info = jnp.iinfo(raw.dtype)
    valid = raw >= 0 if info.min < 0 else jnp.ones(raw.shape, bool)
    if e <= info.max:
        valid = valid & (raw < e)
    ids = jnp.where(valid, raw, 0).astype(jnp.int32)                # valid ids are < 2^31
    return valid, ids, jnp.where(valid, ids, e)                     # invalid last


# Slot counts up to which a slot's rank among its expert's slots is one fused
# pairwise compare (s^2 work, no sort: decode-sized calls); above it a sort.
_PAIRWISE_RANK_SLOTS = 2048
# Each key's count is one fused compare ((E + 1) * s work) up to this size,
# else a scatter-add (its atomics contend on E + 1 counters: 37 us for 131072
# slots of 65 keys on an H200, where the compare takes a few).
_COMPARE_COUNT_WORK = 1 << 26


def counts_and_ranks(key: jax.Array, e: int) -> tuple[jax.Array, jax.Array]:
    """(counts [e + 1]: the slots of each key, q [s]: how many slots before
    i (slot order) have key[i]'s key); keys in [0, e]."""
    s = key.shape[0]
    i = jnp.arange(s, dtype=jnp.int32)
    if s * (e + 1) <= _COMPARE_COUNT_WORK:
        counts = jnp.sum(key[None, :] == jnp.arange(e + 1, dtype=jnp.int32)[:, None], axis=1,
                         dtype=jnp.int32)
    else:
        counts = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)
    if s <= _PAIRWISE_RANK_SLOTS:
        earlier_same = (key[None, :] == key[:, None]) & (i[None, :] < i[:, None])
        return counts, jnp.sum(earlier_same, axis=1, dtype=jnp.int32)
    sorted_key, order = lax.sort((key, i), num_keys=1, is_stable=True)
    starts = exclusive_cumsum(counts, 0)
    return counts, jnp.zeros((s,), jnp.int32).at[order].set(i - starts[sorted_key])


def kept_rows(table: jax.Array, capacity: int | None) -> jax.Array:
    """The rows kept of a count table [source, ...]: each expert's first
    `capacity`, earlier sources first (None: all)."""
    if capacity is None:
        return table
    return jnp.clip(capacity - exclusive_cumsum(table, 0), 0, table)


def slot_tallies(valid: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(num_dropped, num_invalid) of the slots: valid without a row, invalid."""
    return (valid & ~keep).sum().astype(jnp.int32), (~valid).sum().astype(jnp.int32)


def local_layout(expert_ids: jax.Array, num_experts: int, capacity: int | None,
                 num_rows: int) -> tuple[jax.Array, ...]:
    """(dest_row [S], src_slot [num_rows], group_sizes [E], num_dropped [],
    num_invalid []) of expert_ids [S] (any integer dtype; slot i = token * k
    + choice) on one device: valid ids are in [0, E); expert e keeps its
    first `capacity` slots (None: all) as rows exclusive_cumsum(kept)[e] +
    [0, kept[e]); dest_row -1 for dropped and invalid slots, src_slot -1 on
    the rows past sum(kept)."""
    ids = expert_ids.reshape(-1)
    if np.dtype(ids.dtype).itemsize < 4:
        ids = ids.astype(jnp.int32)                                  # lossless widening
    return moe_layout_p.bind(ids, num_experts=int(num_experts),
                             capacity=-1 if capacity is None else int(capacity),
                             num_rows=int(num_rows))


def _layout_abstract(ids, *, num_experts: int, capacity: int, num_rows: int):
    out = lambda *shape: result_aval(ids, shape, dtype=jnp.int32, weak_type=False)
    return out(ids.shape[0]), out(num_rows), out(num_experts), out(), out()


def reference_layout(ids, *, num_experts: int, capacity: int, num_rows: int):
    e = num_experts
    valid, ids, key = slot_keys(ids, e)
    counts, q = counts_and_ranks(key, e)
    kept = kept_rows(counts[None, :e], None if capacity < 0 else capacity)[0]
    keep = valid & (q < kept[ids])
    dest_row = jnp.where(keep, exclusive_cumsum(kept, 0)[ids] + q, -1)
    src_slot = jnp.full((num_rows,), -1, jnp.int32).at[
        jnp.where(keep, dest_row, num_rows)].set(jnp.arange(ids.shape[0], dtype=jnp.int32),
                                                 mode="drop")
    return (dest_row, src_slot, kept) + slot_tallies(valid, keep)


def _layout_fits(ids, *, num_experts: int, capacity: int, num_rows: int) -> bool:
    """Whether the layout kernel takes the call (else the XLA layout)."""
    return (np.dtype(ids.dtype) in _LAYOUT_ID_TYPES and ids.shape[0] <= LAYOUT_MAX_SLOTS and
            num_experts <= LAYOUT_MAX_EXPERTS and num_rows <= LAYOUT_MAX_ROWS)


# Parameters that only give the outputs' shapes (no FFI attribute).
_SHAPE_PARAMS = ("tokens", "num_experts", "num_rows")


def _local_lowering(reference, ffi, multiple_results=False, fits=None):
    """(reference lowering, CUDA lowering) of a one-device primitive: the FFI
    kernel `ffi` (jax.ffi.ffi_lowering of its target) where the extension
    runs and `fits(*avals_in, **params)` (None: always), else the reference
    (after a one-time warning when the extension is missing)."""
    def ref(ctx, *args, **params):
        return mlir.lower_fun(lambda *a: reference(*a, **params),
                              multiple_results=multiple_results)(ctx, *args)

    def cuda(ctx, *args, **params):
        if (fits is not None and not fits(*ctx.avals_in, **params)) or kernels_missing("moe"):
            return ref(ctx, *args, **params)
        attrs = {k: np.int64(v) if isinstance(v, int) and not isinstance(v, bool)
                 else np.int32(v) for k, v in params.items() if k not in _SHAPE_PARAMS}
        return ffi(ctx, *args, **attrs)
    return ref, cuda


for _p, _abstract, _lowerings in (
        (moe_scatter_rows_p, _scatter_abstract,
         _local_lowering(reference_scatter_rows, jax.ffi.ffi_lowering("pk_moe_scatter_rows"))),
        (moe_weighted_sum_p, _sum_abstract,
         _local_lowering(reference_weighted_sum, jax.ffi.ffi_lowering("pk_moe_weighted_sum"))),
        (moe_layout_p, _layout_abstract,
         _local_lowering(reference_layout, jax.ffi.ffi_lowering("pk_moe_layout"),
                         multiple_results=True, fits=_layout_fits))):
    def_eager_impl(_p)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, _lowerings[0])
    mlir.register_lowering(_p, _lowerings[1], platform="cuda")
