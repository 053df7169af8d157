"""pk_jax.all_to_all, moe_dispatch and moe_combine on 8 fake CPU devices:
values and gradients against a dense reference (every token through its
top-k experts), the layout metadata, uneven routing, capacity drops,
out-of-range ids and input checks, on Auto and Explicit meshes."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, ffi_attr, rel_err


def _put(mesh, spec, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]


# ---- all_to_all -------------------------------------------------------------------
@pytest.mark.parametrize("split,concat,tiled", [(0, 0, False), (0, 1, False), (1, 2, False),
                                                (1, 0, True), (2, 1, True), (-2, 0, False)])
def test_all_to_all_matches_lax(rng, sharding_mode, split, concat, tiled):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    x = jnp.asarray(rng.standard_normal((8, 16, 8)), jnp.float32)  # [4, 4, 8] per device
    (x,) = _put(mesh, P("x", "y"), x)

    def run(fn, s):
        f = jax.shard_map(lambda a: fn(a, "y", s, concat, tiled=tiled), mesh=mesh,
                          in_specs=P("x", "y"), out_specs=P("x", "y"))
        return np.asarray(jax.jit(f)(x))
    # lax.all_to_all crashes XLA:CPU (jax 0.10.2) on a negative split axis; ours normalizes.
    np.testing.assert_array_equal(run(pk_jax.all_to_all, split), run(lax.all_to_all, split % 3))


def test_all_to_all_gradient_and_tuple_axes(rng):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((128, 1)), jnp.float32)

    def loss(fn):
        f = jax.shard_map(lambda a: fn(a, ("x", "y"), 1, 0, tiled=True), mesh=mesh,
                          in_specs=P(("x", "y")), out_specs=P(("x", "y")))
        return lambda a: jnp.sum(f(a) ** 2 * c)
    g, g_ref = (jax.grad(loss(fn))(x) for fn in (pk_jax.all_to_all, lax.all_to_all))
    assert np.linalg.norm(g_ref) > 0
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)


def test_all_to_all_errors():
    mesh = cpu_mesh((4,), ("x",))
    x = jnp.ones((6, 4))

    def call(**kw):
        f = jax.shard_map(lambda a: pk_jax.all_to_all(a, "x", **kw), mesh=mesh,
                          in_specs=P(), out_specs=P(), check_vma=False)
        return jax.jit(f)(x)
    with pytest.raises(ValueError, match="not equal to"):
        call(split_axis=0, concat_axis=0)
    with pytest.raises(ValueError, match="not divisible"):
        call(split_axis=0, concat_axis=0, tiled=True)
    with pytest.raises(ValueError, match="out of range"):
        call(split_axis=2, concat_axis=0)
    with pytest.raises(ValueError, match="mechanism"):
        call(split_axis=1, concat_axis=0, mechanism="nccl")
    with pytest.raises(TypeError, match="split_axis must be an int .*0.0"):
        call(split_axis=0.0, concat_axis=0)
    with pytest.raises(TypeError, match="concat_axis must be an int"):
        call(split_axis=0, concat_axis="1")


# ---- dispatch / combine -----------------------------------------------------------
@functools.partial(jax.jit, static_argnums=4)  # one compile, not one per eager op
def _dense(x, ids, w, wts, num_experts):
    """Every token through its top-k experts (linear experts W[e]), weighted;
    out-of-range ids contribute nothing."""
    valid = (ids >= 0) & (ids < num_experts)
    h = jnp.einsum("th,tkhf->tkf", x, wts[jnp.clip(ids, 0, num_experts - 1)])
    return jnp.einsum("tk,tkf->tf", jnp.where(valid, w, 0), h)


def _moe_fn(mesh, num_experts, capacity=None, extra=False, mechanism="auto"):
    """shard_map'd dispatch -> ragged_dot with the local experts -> combine."""
    def body(x, ids, w, wts):
        rows, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=num_experts,
                                        capacity=capacity, mechanism=mechanism)
        y = lax.ragged_dot(rows, wts, lay.group_sizes)
        out = pk_jax.moe_combine(y, w, lay)
        if not extra:
            return out
        return (out, rows, lay.group_sizes[None], lay.src_rank, lay.src_slot,
                lay.dest_row, lay.num_dropped[None], lay.num_invalid[None])
    spec = P("ep")
    outs = spec if not extra else (spec,) * 8
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=outs))


def _inputs(rng, n, t, k, h, e, f=6, ids=None, dtype=jnp.float32):
    x = jnp.asarray(rng.standard_normal((n * t, h)), dtype)
    if ids is None:
        ids = np.stack([rng.permutation(e)[:k] for _ in range(n * t)])
    w = jnp.asarray(rng.random((n * t, k)), dtype)
    wts = jnp.asarray(rng.standard_normal((e, h, f)) / np.sqrt(h), dtype)
    return x, jnp.asarray(ids, jnp.int32), w, wts


def _check_values_and_grads(mesh, x, ids, w, wts, e, tol=1e-5, mechanism="auto"):
    args = _put(mesh, P("ep"), x, ids, w, wts)
    f = _moe_fn(mesh, e, mechanism=mechanism)
    with jax.set_mesh(mesh):
        return _values_and_grads(f, args, x, ids, w, wts, e, tol)


def _values_and_grads(f, args, x, ids, w, wts, e, tol):
    out = f(*args)
    ref = _dense(x, ids, w, wts, e)
    assert rel_err(out, ref) < tol
    cot = jnp.asarray(np.random.default_rng().standard_normal(ref.shape), ref.dtype)
    g = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, args[1], b, c) * cot),
                         argnums=(0, 1, 2)))(args[0], args[2], args[3])
    g_ref = jax.jit(jax.grad(lambda a, b, c: jnp.sum(_dense(a, ids, b, c, e) * cot),
                             argnums=(0, 1, 2)))(x, w, wts)
    for name, a, b in zip(("x", "weights", "experts"), g, g_ref):
        if np.linalg.norm(np.asarray(b, np.float64)) == 0:
            assert np.linalg.norm(np.asarray(a, np.float64)) == 0, name
        else:
            assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("k,e", [(1, 8), (2, 8), (8, 16), (2, 4)])
def test_matches_dense_reference(rng, sharding_mode, k, e):
    mesh = cpu_mesh((4,), ("ep",))
    _check_values_and_grads(mesh, *_inputs(rng, 4, 6, k, 8, e), e)


def test_eight_ranks_one_expert_each(rng, sharding_mode):
    mesh = cpu_mesh((8,), ("ep",))
    _check_values_and_grads(mesh, *_inputs(rng, 8, 5, 2, 4, 8), 8)


def test_uneven_routing(rng, sharding_mode):
    """Expert 3 takes every token's first choice, experts 4..7 nothing at
    all (rank 2 receives no rows), duplicate choices allowed."""
    mesh = cpu_mesh((4,), ("ep",))
    n, t, e = 4, 6, 8
    ids = np.stack([np.full(n * t, 3), rng.integers(0, 4, n * t)], axis=1)
    x, ids, w, wts = _inputs(rng, n, t, 2, 8, e, ids=ids)
    _check_values_and_grads(mesh, x, ids, w, wts, e)
    out = _moe_fn(mesh, e, extra=True)(*_put(mesh, P("ep"), x, ids, w, wts))
    sizes = np.asarray(out[2]).reshape(n, 2)
    np.testing.assert_array_equal(sizes.reshape(-1), np.bincount(np.asarray(ids).ravel(),
                                                                 minlength=e))
    assert sizes[2].sum() == sizes[3].sum() == 0


def test_everything_to_one_expert(rng):
    mesh = cpu_mesh((4,), ("ep",))
    x, ids, w, wts = _inputs(rng, 4, 5, 1, 8, 4, ids=np.full((20, 1), 2))
    _check_values_and_grads(mesh, x, ids, w, wts, 4)


def test_layout_metadata(rng, sharding_mode):
    """Rows land grouped by local expert, then source rank, then slot; each
    row is its source token; padding rows are zero."""
    mesh = cpu_mesh((4,), ("ep",))
    n, t, k, e = 4, 6, 2, 8
    x, ids, w, wts = _inputs(rng, n, t, k, 8, e)
    out = _moe_fn(mesh, e, extra=True)(*_put(mesh, P("ep"), x, ids, w, wts))
    _, rows, sizes, src_rank, src_slot, dest_row, dropped, invalid = map(np.asarray, out)
    r = n * t * k                                  # drop-less bound: n * T * k rows per rank
    assert rows.shape == (n * r, 8)
    assert dropped.sum() == invalid.sum() == 0
    xs, idn = np.asarray(x).reshape(n, t, 8), np.asarray(ids).reshape(n, t, k)
    sizes = sizes.reshape(n, 2)
    for d in range(n):
        got = rows[d * r:(d + 1) * r]
        sr, ss = src_rank[d * r:(d + 1) * r], src_slot[d * r:(d + 1) * r]
        used = int(sizes[d].sum())
        assert (sr[:used] >= 0).all() and (sr[used:] == -1).all() and (ss[used:] == -1).all()
        np.testing.assert_array_equal(got[used:], 0)
        keys = []
        for p in range(used):
            s, slot = sr[p], ss[p]
            np.testing.assert_array_equal(got[p], xs[s, slot // k])
            expert = idn[s, slot // k, slot % k]
            assert expert // 2 == d
            keys.append((expert % 2, s, slot))
            # the sender knows where it went
            assert dest_row.reshape(n, t, k)[s, slot // k, slot % k] == p
        assert keys == sorted(keys)
        np.testing.assert_array_equal([sum(1 for q in keys if q[0] == l) for l in range(2)],
                                      sizes[d])


def _kept_mask(ids, n, t, k, e, capacity):
    """numpy: which slots an expert keeps (first `capacity` rows in
    (source rank, slot) order)."""
    flat = np.asarray(ids).reshape(n, t * k)
    seen = np.zeros(e, int)
    keep = np.zeros_like(flat, bool)
    for s in range(n):
        for slot in range(t * k):
            ex = flat[s, slot]
            if 0 <= ex < e and seen[ex] < capacity:
                keep[s, slot] = True
                seen[ex] += 1
    return keep.reshape(n * t, k)


def _hot_routing(rng, hot, capacity):
    """4 ranks x 6 tokens, each choosing 2 of the first `hot` of 8 experts
    (crowded: drops under a capacity). (mesh, inputs (x, ids, w, wts), the
    kept mask under `capacity` (None: drop-less), the sharded inputs)."""
    mesh = cpu_mesh((4,), ("ep",))
    n, t, k, e = 4, 6, 2, 8
    ids = np.stack([rng.choice(hot, 2, replace=False) for _ in range(n * t)])
    x, ids, w, wts = _inputs(rng, n, t, k, 8, e, ids=ids)
    keep = _kept_mask(ids, n, t, k, e, capacity or n * t * k)
    return mesh, (x, ids, w, wts), keep, _put(mesh, P("ep"), x, ids, w, wts)


def _check_kept(mesh, f, args, inputs, keep):
    """f's output and its gradients (tokens, weights) against the dense
    reference with the dropped choices' weights zeroed."""
    x, ids, w, wts = inputs
    e = wts.shape[0]
    assert rel_err(f(*args)[0], _dense(x, ids, jnp.where(keep, w, 0), wts, e)) < 1e-5
    with jax.set_mesh(mesh):
        g = jax.grad(lambda a, b: jnp.sum(f(a, args[1], b, args[3])[0] ** 2), argnums=(0, 1))(
            args[0], args[2])
    g_ref = jax.grad(lambda a, b: jnp.sum(_dense(a, ids, jnp.where(keep, b, 0), wts, e) ** 2),
                     argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("capacity", [1, 3, 100])
def test_capacity_drops_and_counts(rng, sharding_mode, capacity):
    mesh, inputs, keep, args = _hot_routing(rng, 3, capacity)  # hot experts 0..2
    n, e = 4, 8
    f = _moe_fn(mesh, e, capacity=capacity, extra=True)
    out, rows, sizes, _, _, dest_row, dropped, invalid = f(*args)
    # 2 local experts x the capacity, clamped at every slot of the axis (n * t * k = 48)
    assert rows.shape == (n * 2 * min(capacity, 48), 8)
    np.testing.assert_array_equal(np.asarray(dropped), (~keep).reshape(n, -1).sum(1))
    assert np.asarray(invalid).sum() == 0
    assert ((np.asarray(dest_row) >= 0) == keep).all()
    _check_kept(mesh, f, args, inputs, keep)


def test_out_of_range_ids_dropped_and_counted(rng, sharding_mode):
    mesh = cpu_mesh((4,), ("ep",))
    n, t, k, e = 4, 6, 2, 8
    x, ids, w, wts = _inputs(rng, n, t, k, 8, e)
    bad = np.asarray(ids).copy()
    bad[0, 1], bad[7, 0], bad[23, 1] = -1, e, 1000
    bad = jnp.asarray(bad)
    out = _moe_fn(mesh, e, extra=True)(*_put(mesh, P("ep"), x, bad, w, wts))
    np.testing.assert_array_equal(np.asarray(out[7]), [1, 1, 0, 1])
    assert np.asarray(out[6]).sum() == 0
    assert rel_err(out[0], _dense(x, bad, w, wts, e)) < 1e-5
    assert int(np.asarray(out[2]).sum()) == n * t * k - 3


def test_bfloat16(rng):
    mesh = cpu_mesh((4,), ("ep",))
    x, ids, w, wts = _inputs(rng, 4, 8, 2, 16, 8, dtype=jnp.bfloat16)
    out = _moe_fn(mesh, 8)(*_put(mesh, P("ep"), x, ids, w, wts))
    assert out.dtype == jnp.bfloat16
    ref = _dense(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                   for a in (x, ids, w, wts)), 8)
    assert rel_err(out, ref) < 2e-2


def test_dispatch_and_combine_are_transposes(rng):
    """<dispatch(x), r> == <x, dispatch^T(r)> and the same for combine's exchange."""
    mesh = cpu_mesh((4,), ("ep",))
    n, t, k, e = 4, 5, 2, 8
    x, ids, w, _ = _inputs(rng, n, t, k, 3, e)
    r = jnp.asarray(rng.standard_normal((n * n * t * k, 3)), jnp.float32)

    def body(x, ids, w, r):
        rows, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=e)
        back = jax.vjp(lambda a: pk_jax.moe_dispatch(a, ids, "ep", num_experts=e)[0], x)[1](r)
        lhs = lax.psum(jnp.sum(rows * r), "ep")
        rhs = lax.psum(jnp.sum(x * back[0]), "ep")
        comb = pk_jax.moe_combine(r, jnp.ones_like(w), lay)
        back_c = jax.vjp(lambda a: pk_jax.moe_combine(a, jnp.ones_like(w), lay), r)[1](x)
        lhs_c = lax.psum(jnp.sum(comb * x), "ep")
        rhs_c = lax.psum(jnp.sum(r * back_c[0]), "ep")
        return jnp.stack([lhs, rhs, lhs_c, rhs_c])[None]
    vals = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))(
        *_put(mesh, P("ep"), x, ids, w, r))
    lhs, rhs, lhs_c, rhs_c = np.asarray(vals)[0]
    assert abs(lhs - rhs) < 1e-4 * abs(lhs) and abs(lhs_c - rhs_c) < 1e-4 * abs(lhs_c)


def test_int64_ids_beyond_int32_are_invalid_not_wrapped(rng):
    """With x64 on, an id of 2^32 + 3 is out of range (counted in
    num_invalid, no row), not expert 3; so are 2^31 and -2^32 + 1."""
    mesh = cpu_mesh((4,), ("ep",))
    n, t, k, e = 4, 6, 2, 8
    x, ids, w, wts = _inputs(rng, n, t, k, 8, e)
    with jax.enable_x64(True):
        bad = np.asarray(ids).astype(np.int64)
        bad[0, 1], bad[7, 0], bad[23, 1] = 2**32 + 3, 2**31, -2**32 + 1
        bad = jnp.asarray(bad, jnp.int64)
        out = _moe_fn(mesh, e, extra=True)(*_put(mesh, P("ep"), x, bad, w, wts))
        np.testing.assert_array_equal(np.asarray(out[7]), [1, 1, 0, 1])
        assert int(np.asarray(out[2]).sum()) == n * t * k - 3
        want = _dense(x, jnp.asarray(np.where((bad >= 0) & (bad < e), bad, -1), jnp.int32),
                      w, wts, e)
    assert rel_err(out[0], want) < 1e-5


def test_capacity_clamped_and_int32_row_bounds():
    """A capacity above every slot of the axis (n * T * k) drops nothing and
    is clamped to it (10**9 and 2**31 give 2 * 32 rows, not billions); row
    counts past int32 are refused naming the argument."""
    mesh = cpu_mesh((4,), ("ep",))

    def rows_shape(x, ids, **kw):
        f = jax.shard_map(lambda a, b: pk_jax.moe_dispatch(a, b, "ep", **kw)[0], mesh=mesh,
                          in_specs=P("ep"), out_specs=P("ep"))
        return jax.eval_shape(f, x, ids).shape
    x, ids = jnp.ones((16, 4)), jnp.zeros((16, 2), jnp.int32)  # T = 4, k = 2 per rank
    for capacity in (32, 10**9, 2**31, 2**70):
        assert rows_shape(x, ids, num_experts=8, capacity=capacity) == (4 * 2 * 32, 4)
    assert rows_shape(x, ids, num_experts=8, capacity=3) == (4 * 2 * 3, 4)
    shapes = lambda t, k: (jax.ShapeDtypeStruct((4 * t, 4), jnp.float32),
                           jax.ShapeDtypeStruct((4 * t, k), jnp.int32))
    with pytest.raises(ValueError, match="slots: row indices are int32"):
        rows_shape(*shapes(2**28, 2), num_experts=8)  # 4 x 2^28 x 2 = 2^31 slots
    with pytest.raises(ValueError, match="capacity=.*rows per rank: row indices are int32"):
        rows_shape(*shapes(2**27, 1), num_experts=4 * 64, capacity=2**26)  # 64 x 2^26 rows
    with pytest.raises(ValueError, match="num_experts=.* below 2\\^31"):
        rows_shape(x, ids, num_experts=4 * 2**30)


def test_static_errors():
    mesh = cpu_mesh((4,), ("ep",))

    def dispatch(x, ids, **kw):
        kw.setdefault("num_experts", 8)
        f = jax.shard_map(lambda a, b: pk_jax.moe_dispatch(a, b, "ep", **kw)[0], mesh=mesh,
                          in_specs=P("ep"), out_specs=P("ep"))
        return jax.jit(f)(x, ids)
    x, ids = jnp.ones((16, 4)), jnp.zeros((16, 2), jnp.int32)
    with pytest.raises(ValueError, match="top-k = 9"):
        dispatch(x, jnp.zeros((16, 9), jnp.int32))
    with pytest.raises(ValueError, match="multiple of the 4 devices"):
        dispatch(x, ids, num_experts=6)
    with pytest.raises(ValueError, match="integers"):
        dispatch(x, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="floating point"):
        dispatch(x.astype(jnp.int32), ids)
    with pytest.raises(ValueError, match="tokens"):
        dispatch(x, jnp.zeros((8, 2), jnp.int32))
    with pytest.raises(ValueError, match="capacity"):
        dispatch(x, ids, capacity=0)
    with pytest.raises(ValueError, match="mechanism"):
        dispatch(x, ids, mechanism="nccl")

    def combine(y_rows, w):
        def body(a, b):
            rows, lay = pk_jax.moe_dispatch(a, b, "ep", num_experts=8)
            return pk_jax.moe_combine(rows[:y_rows], w, lay)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x, ids)
    with pytest.raises(ValueError, match="num_rows=32"):
        combine(5, jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="weights must be"):
        combine(None, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="floating point"):
        combine(None, jnp.ones((4, 2), jnp.int32))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """lax.ragged_all_to_all's semantics from all_gathers (XLA:CPU has none)."""
    ops = lax.all_gather(operand, axis_name)
    starts, sizes, dests = (lax.all_gather(a, axis_name)
                            for a in (input_offsets, send_sizes, output_offsets))
    me = lax.axis_index(axis_name)
    p = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        lo, size = dests[s, me], sizes[s, me]
        inside = (p >= lo) & (p < lo + size)
        src = jnp.clip(starts[s, me] + p - lo, 0, operand.shape[0] - 1)
        output = jnp.where(inside.reshape((-1,) + (1,) * (output.ndim - 1)), ops[s, src],
                           output)
    return output


@pytest.mark.parametrize("capacity", [None, 2])
def test_ragged_exchange_logic(rng, monkeypatch, capacity):
    """The "ragged" mechanism's GPU branch (offsets and sizes of
    ragged_all_to_all), run on CPU against an emulation of the collective."""
    calls = []
    monkeypatch.setattr(lax, "ragged_all_to_all",
                        lambda *a, **kw: calls.append(1) or _emulated_ragged_all_to_all(*a, **kw))
    monkeypatch.setattr(lax, "platform_dependent", lambda *a, cpu, default: default(*a))
    mesh, inputs, keep, args = _hot_routing(rng, 5, capacity)
    f = _moe_fn(mesh, 8, capacity=capacity, extra=True, mechanism="ragged")
    f(*args)
    assert len(calls) == 3  # source slots, dispatch, combine
    _check_kept(mesh, f, args, inputs, keep)


@pytest.mark.parametrize("mechanism", ["xla", "ld_st"])
def test_mechanisms_match_dense_reference(rng, mechanism):
    """"xla" and the kernel primitive's plumbing ("ld_st": on CPU the
    primitive lowers to its dense reference) give the dense reference."""
    mesh = cpu_mesh((4,), ("ep",))
    _check_values_and_grads(mesh, *_inputs(rng, 4, 6, 2, 8, 8), 8, mechanism=mechanism)


@pytest.mark.parametrize("capacity", [None, 2])
def test_ld_st_layout_and_drops(rng, capacity):
    mesh, (x, ids, w, wts), keep, args = _hot_routing(rng, 3, capacity)
    e = 8
    ours = _moe_fn(mesh, e, capacity, extra=True, mechanism="ld_st")(*args)
    ref = _moe_fn(mesh, e, capacity, extra=True, mechanism="xla")(*args)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert rel_err(ours[0], _dense(x, ids, jnp.where(keep, w, 0), wts, e)) < 1e-5


@pytest.mark.parametrize("mechanism", ["ld_st", "auto"])
def test_ld_st_lowers_to_the_kernel(cuda_lowering, mechanism):
    """On CUDA, mechanism="ld_st" (and "auto", pk_jax/tuning.py) is
    pk_moe_exchange custom calls (the source slots, the rows) with the
    staging region sized for the output rows."""
    mesh = cpu_mesh((4,), ("ep",))
    ids = jnp.zeros((8, 2), jnp.int32)

    def fn(a):
        rows, lay = pk_jax.moe_dispatch(a, ids, "ep", num_experts=8, mechanism=mechanism)
        return pk_jax.moe_combine(rows, jnp.ones((8, 2)), lay)
    hlo = cuda_lowering(fn, mesh, P("ep"), (32, 16))
    calls = re.findall(r"custom_call @pk_moe_exchange\((.*)", hlo)
    assert len(calls) == 3, hlo  # source slots, dispatch, combine
    assert "custom_call @pk_all_gather(" in hlo  # the count table: no XLA collective at all
    assert not re.search(r"stablehlo\.(all_to_all|all_gather|collective)", hlo)
    assert sorted(int(ffi_attr(c, "row_bytes")) for c in calls) == [4, 64, 64]


def test_one_device_auto_lowers_to_the_row_kernels(cuda_lowering):
    """On CUDA, `auto` on an axis of one device is pk_moe_scatter_rows
    (dispatch; combine's input gradient, scaled by the weights) and
    pk_moe_weighted_sum (combine, weighted; dispatch's input gradient), with
    no collective and no exchange kernel."""
    mesh = cpu_mesh((1,), ("ep",))
    ids = jnp.asarray(np.arange(16).reshape(8, 2) % 4, jnp.int32)

    def loss(a):
        rows, lay = pk_jax.moe_dispatch(a, ids, "ep", num_experts=4)
        return pk_jax.moe_combine(rows * 2, jnp.full((8, 2), 0.5), lay)

    def fn(a):
        return jax.grad(lambda b: jnp.sum(loss(b) ** 2))(a)
    hlo = cuda_lowering(fn, mesh, P("ep"), (8, 16))
    gathers = re.findall(r"custom_call @pk_moe_scatter_rows\((.*)", hlo)
    sums = re.findall(r"custom_call @pk_moe_weighted_sum\((.*)", hlo)
    assert sorted(int(ffi_attr(c, "scaled")) for c in gathers) == [0, 1], hlo
    assert sorted(int(ffi_attr(c, "weighted")) for c in sums) == [0, 1], hlo
    assert all(int(ffi_attr(c, "repeat")) == 2 for c in gathers)
    assert "pk_moe_exchange" not in hlo
    assert not re.search(r"stablehlo\.(all_to_all|all_gather|collective)", hlo)


def test_row_primitives_reference(rng):
    """The one-device primitives' semantics (their CPU lowering) against
    numpy: indices out of range give zeros (gather) or nothing (sum), the
    scale is each slot's, the sum is weighted in fp32."""
    from pk_jax.ops.moe.primitive import scatter_rows, weighted_sum
    src = rng.standard_normal((5, 6)).astype(np.float32)
    row_slot = np.array([3, -1, 9, 0, 14, 15, 7], np.int32)   # slots of 5 tokens x 3; 15: out
    dest = np.full(15, -1, np.int32)
    dest[row_slot[(row_slot >= 0) & (row_slot < 15)]] = np.flatnonzero(
        (row_slot >= 0) & (row_slot < 15))
    scale = rng.random(15).astype(np.float32)
    got = np.asarray(scatter_rows(jnp.asarray(src), jnp.asarray(dest), jnp.asarray(row_slot), 3,
                                  jnp.asarray(scale)))
    for r, i in enumerate(row_slot):
        want = src[i // 3] * scale[i] if 0 <= i < 15 else np.zeros(6, np.float32)
        np.testing.assert_allclose(got[r], want, rtol=1e-6)
    rows = rng.standard_normal((4, 6)).astype(np.float32)
    idx = np.array([[0, 3], [-1, 2], [4, 1]], np.int32)     # 4 and -1: no row
    w = rng.random((3, 2)).astype(np.float32)
    out = np.asarray(weighted_sum(jnp.asarray(rows), jnp.asarray(idx.reshape(-1)),
                                  jnp.asarray(w.reshape(-1)), 3))
    want = np.stack([sum(w[t, j] * rows[i] for j, i in enumerate(idx[t]) if 0 <= i < 4)
                     for t in range(3)])
    np.testing.assert_allclose(out, want, rtol=1e-6)
    unweighted = np.asarray(weighted_sum(jnp.asarray(rows), jnp.asarray(idx.reshape(-1)),
                                         None, 3))
    np.testing.assert_allclose(unweighted, [rows[0] + rows[3], rows[2], rows[1]], rtol=1e-6)


@pytest.mark.parametrize("s", [7, 1000, 2049, 5000])
def test_counts_and_ranks_every_path(rng, s, monkeypatch):
    """Each key's count (a compare, or a scatter-add) and a slot's rank among
    its key's slots (the pairwise compare of small calls, or the sort of
    large ones), against a numpy count, on both sides of the sizes that pick
    between them."""
    from pk_jax.ops.moe import primitive as mp
    e = 9
    key = rng.integers(0, e + 1, size=s).astype(np.int32)
    seen = np.zeros(e + 1, np.int64)
    want = np.empty(s, np.int64)
    for i, kk in enumerate(key):
        want[i] = seen[kk]
        seen[kk] += 1
    for pairwise, compare in ((0, 1 << 30), (0, 0), (1 << 30, 0), (1 << 30, 1 << 30)):
        monkeypatch.setattr(mp, "_PAIRWISE_RANK_SLOTS", pairwise)
        monkeypatch.setattr(mp, "_COMPARE_COUNT_WORK", compare)
        counts, q = mp.counts_and_ranks(jnp.asarray(key), e)   # eager: traced per call
        np.testing.assert_array_equal(np.asarray(q), want)
        np.testing.assert_array_equal(np.asarray(counts), seen)


@pytest.mark.parametrize("capacity", [None, 3])
def test_one_device_auto_is_the_local_gathers(rng, sharding_mode, capacity):
    """On an expert axis of one device `auto` runs the local exchange (one
    gather each way, pk_jax/tuning.py moe_mechanism): the same rows, layout,
    output and gradients, bit for bit, as the "xla" exchange, with crowded
    routing (drops under a capacity) and out-of-range ids; and no
    collective or pk custom call in its program."""
    mesh = cpu_mesh((1,), ("ep",))
    t, k, e = 24, 2, 8
    ids = np.stack([rng.choice(3, k, replace=False) for _ in range(t)])   # 3 of 8 experts
    ids[5, 1], ids[9, 0] = e + 2, -1                                      # invalid: dropped
    x, ids, w, wts = _inputs(rng, 1, t, k, 8, e, ids=ids)
    args = _put(mesh, P("ep"), x, ids, w, wts)
    local = _moe_fn(mesh, e, capacity=capacity, extra=True, mechanism="auto")
    ref = _moe_fn(mesh, e, capacity=capacity, extra=True, mechanism="xla")
    with jax.set_mesh(mesh):
        for a, b in zip(local(*args), ref(*args)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        loss = lambda f: lambda a, b, c: jnp.sum(f(a, args[1], b, c)[0] ** 2)
        grads = [jax.grad(loss(f), argnums=(0, 1, 2))(args[0], args[2], args[3])
                 for f in (local, ref)]
        text = local.lower(*args).as_text()
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    keep = _kept_mask(ids, 1, t, k, e, capacity or t * k)
    assert rel_err(local(*args)[0], _dense(x, ids, jnp.where(keep, w, 0), wts, e)) < 1e-5
    assert not re.search(r"all_to_all|all_gather|collective|custom_call", text)


# ---- the one-device layout primitive (pk_moe_layout) --------------------------------
def np_local_layout(ids, e, capacity, num_rows):
    """ops/moe/primitive.py's local_layout in numpy, slot by slot: (dest_row, src_slot,
    group_sizes, num_dropped, num_invalid)."""
    ids = np.asarray(ids).reshape(-1)
    valid = (ids >= 0) & (ids < e)
    key = np.where(valid, ids, e).astype(np.int64)
    counts = np.zeros(e + 1, np.int64)
    q = np.empty(len(key), np.int64)
    for i, kk in enumerate(key):
        q[i], counts[kk] = counts[kk], counts[kk] + 1
    kept = counts[:e] if capacity is None else np.minimum(counts[:e], capacity)
    base = np.cumsum(kept) - kept
    dest_row = np.full(len(key), -1, np.int64)
    src_slot = np.full(num_rows, -1, np.int64)
    for i, kk in enumerate(key):
        if kk < e and q[i] < kept[kk]:
            dest_row[i] = base[kk] + q[i]
            src_slot[dest_row[i]] = i
    return dest_row, src_slot, kept, int(valid.sum() - kept.sum()), int((~valid).sum())


def random_ids(rng, s, e, dtype=np.int32):
    """s expert ids, half of them on 3 hot experts (capacity drops), with
    invalid ones below 0 and at or above e (beyond 2^32 for 64-bit ids)."""
    ids = rng.integers(-3, e + 3, s).astype(np.int64)
    hot = rng.random(s) < 0.5
    ids[hot] = rng.integers(0, min(e, 3), int(hot.sum()))
    if np.dtype(dtype).itemsize == 8 and s > 2:
        ids[rng.integers(0, s, 2)] = [2**32 + 1, -2**40]
    if np.dtype(dtype).kind == "u":
        ids = np.where(ids < 0, np.iinfo(dtype).max, ids)
    return ids.astype(dtype)


@pytest.mark.parametrize("s,e,capacity,dtype", [
    (1, 1, None, np.int32), (31, 8, 2, np.int32), (1000, 5, None, np.int32),
    (1025, 255, 3, np.int32), (2049, 8, 300, np.int32), (5000, 7, None, np.int32),
    (3000, 64, 20, np.int64), (600, 6, 50, np.uint32), (500, 3, None, np.int8),
    (400, 200, 1, np.uint8), (64, 4, 10**6, np.int64)])
def test_layout_primitive_reference(rng, s, e, capacity, dtype):
    """The layout primitive's XLA reference (its CPU lowering; the layout on
    CUDA beyond the kernel's bounds) against numpy on fresh random ids:
    invalid ids (negative, >= E, beyond 2^32), capacity drops, E not a power
    of two, the pairwise and the sorted ranks, narrow and 64-bit ids."""
    from pk_jax.ops.moe.primitive import local_layout
    with jax.enable_x64(np.dtype(dtype).itemsize == 8):
        ids = random_ids(rng, s, e, dtype)
        cap = None if capacity is None else min(capacity, s)
        rows = s if cap is None else e * cap
        got = local_layout(jnp.asarray(ids), e, cap, rows)
        for a, b in zip(got, np_local_layout(ids, e, cap, rows)):
            assert a.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("capacity", [None, 3])
def test_local_layout_is_the_exchange_layout(rng, capacity, x64):
    """Every field of the local layout (the primitive's five outputs, the
    exchange fields derived from them) equals, bit for bit and dtype for
    dtype, what the exchanges' layout gives on one device."""
    mesh = cpu_mesh((1,), ("ep",))
    t, k, e = 40, 2, 6

    def fn(mechanism):
        def body(x, ids):
            _, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=e, capacity=capacity,
                                         mechanism=mechanism)
            return [a.reshape(-1) for a in jax.tree.leaves(lay)]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with jax.enable_x64(x64):
        ids = random_ids(rng, t * k, e, np.int64 if x64 else np.int32).reshape(t, k)
        args = _put(mesh, P("ep"), jnp.ones((t, 4)), jnp.asarray(ids))
        with jax.set_mesh(mesh):
            local, ref = fn("auto")(*args), fn("xla")(*args)
    assert len(local) == len(ref) == 13
    for a, b in zip(local, ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_local_layout_lowers_to_the_kernel(cuda_lowering):
    """On CUDA, the one-device layout is one pk_moe_layout custom call (the
    flat ids in, dest_row, src_slot, group_sizes and the two tallies out,
    the capacity an attribute, -1 drop-less), computed once for dispatch,
    combine and the gradients; no sort or scatter of XLA's is left."""
    mesh = cpu_mesh((1,), ("ep",))
    ids = jnp.asarray(np.arange(24).reshape(12, 2) % 7, jnp.int32)

    def loss(a, capacity):
        rows, lay = pk_jax.moe_dispatch(a, ids, "ep", num_experts=6, capacity=capacity)
        return pk_jax.moe_combine(rows * 2, jnp.full((12, 2), 0.5), lay)

    for capacity, rows in ((None, 24), (3, 18)):
        fn = lambda a: jax.grad(lambda b: jnp.sum(loss(b, capacity) ** 2))(a)
        hlo = cuda_lowering(fn, mesh, P("ep"), (12, 16))
        calls = re.findall(r"custom_call @pk_moe_layout\((.*)", hlo)
        assert len(calls) == 1, hlo
        assert int(ffi_attr(calls[0], "capacity")) == (-1 if capacity is None else capacity)
        assert ("(tensor<24xi32>) -> (tensor<24xi32>, tensor<%dxi32>, tensor<6xi32>, "
                "tensor<i32>, tensor<i32>)" % rows) in calls[0]
        assert not re.search(r"stablehlo\.(sort|scatter)", hlo), hlo


@pytest.mark.parametrize("what", ["slots", "experts", "rows", "uint32", "int64"])
def test_local_layout_kernel_bounds(cuda_lowering, what):
    """On CUDA the layout kernel takes int32 and int64 ids; calls beyond its
    bounds (slots, experts, rows: moe/primitive.py's LAYOUT_MAX_*) or with ids it
    does not read lower to the XLA layout."""
    from pk_jax.ops.moe import primitive as mp
    mesh = cpu_mesh((1,), ("ep",))
    t, e, capacity, dtype = 64, 8, None, jnp.int32
    if what == "slots":
        t = mp.LAYOUT_MAX_SLOTS + 1
    elif what == "experts":
        e = mp.LAYOUT_MAX_EXPERTS + 1
    elif what == "rows":
        t, capacity = mp.LAYOUT_MAX_ROWS // e + 1, mp.LAYOUT_MAX_ROWS // e + 1
    else:
        dtype = jnp.uint32 if what == "uint32" else jnp.int64

    def fn(a):
        ids = jnp.zeros((t, 1), dtype)
        rows, lay = pk_jax.moe_dispatch(a, ids, "ep", num_experts=e, capacity=capacity)
        return pk_jax.moe_combine(rows, jnp.ones((t, 1)), lay)
    with jax.enable_x64(what == "int64"):
        hlo = cuda_lowering(fn, mesh, P("ep"), (t, 8))
    kernel = re.findall(r"custom_call @pk_moe_layout\((.*)", hlo)
    if what == "int64":
        assert len(kernel) == 1 and "(tensor<64xi64>) ->" in kernel[0]
    else:
        assert not kernel and "pk_moe_scatter_rows" in hlo
