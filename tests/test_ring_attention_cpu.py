"""ring_attention on fake CPU devices: values, log-sum-exp and gradients
against jax.nn.dot_product_attention on the whole sequence, for both layouts,
GQA, several world sizes (n=3 catches ring indexing bugs), zigzag reordering,
and input checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from pk_jax import reference, tuning
from pk_jax.ops.ring_attention import ring_attention
from pk_jax.ops.ring_attention.zigzag import zigzag_shard, zigzag_unshard

SEQ = P(None, "sp")


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _qkv(rng, b, s, hq, hkv, d, dtype=jnp.float32):
    return (_normal(rng, (b, s, hq, d), dtype), _normal(rng, (b, s, hkv, d), dtype),
            _normal(rng, (b, s, hkv, d), dtype))


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def _sharded(mesh, layout="contiguous", return_lse=False, check_vma=False, **kw):
    """Global q, k, v (natural order) -> global output (natural order), via the ring."""
    n = mesh.shape["sp"]
    out_specs = (SEQ, P(None, None, "sp")) if return_lse else SEQ
    f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "sp", layout=layout,
                                                     return_lse=return_lse, **kw),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=out_specs,
                      check_vma=check_vma)
    if layout == "contiguous":
        return f

    def zig(q, k, v):
        res = f(*(zigzag_shard(x, n) for x in (q, k, v)))
        if return_lse:
            return zigzag_unshard(res[0], n), zigzag_unshard(res[1], n, seq_axis=2)
        return zigzag_unshard(res, n)
    return zig


@functools.partial(jax.jit, static_argnums=(3, 4))
def _reference(q, k, v, causal, scale=None):
    return jax.nn.dot_product_attention(*_f32(q, k, v), is_causal=causal, scale=scale)


@functools.partial(jax.jit, static_argnums=3)
def _reference_lse(q, k, v, causal):
    q, k, v = _f32(q, k, v)
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, g, axis=2)) / np.sqrt(q.shape[3])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


# ---- values --------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_values(rng, n, layout, causal):
    q, k, v = _qkv(rng, 2, 8 * n, 8, 2, 64)
    out = jax.jit(_sharded(cpu_mesh((n,), ("sp",)), layout, causal=causal))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    assert rel_err(out, _reference(q, k, v, causal)) < 1e-5


@pytest.mark.parametrize("hkv", [8, 2, 1])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_and_head_dim(rng, hkv, d):
    q, k, v = _qkv(rng, 2, 24, 8, hkv, d)
    out = jax.jit(_sharded(cpu_mesh((3,), ("sp",)), "zigzag", causal=True))(q, k, v)
    assert rel_err(out, _reference(q, k, v, True)) < 1e-5


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_bf16(rng, layout):
    q, k, v = _qkv(rng, 2, 64, 8, 2, 64, jnp.bfloat16)
    out = jax.jit(_sharded(cpu_mesh((4,), ("sp",)), layout, causal=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, _reference(q, k, v, True)) < 2e-2


def test_scale_mechanism_and_vma_check(rng):
    q, k, v = _qkv(rng, 1, 32, 4, 4, 64)
    f = _sharded(cpu_mesh((4,), ("sp",)), "zigzag", check_vma=True, causal=True, scale=0.3,
                 mechanism="xla")
    assert rel_err(jax.jit(f)(q, k, v), _reference(q, k, v, True, scale=0.3)) < 1e-5


def test_long_local_block(rng):
    q, k, v = _qkv(rng, 1, 128, 4, 1, 64)
    out = jax.jit(_sharded(cpu_mesh((2,), ("sp",)), causal=True))(q, k, v)
    assert rel_err(out, _reference(q, k, v, True)) < 1e-5


def test_tuple_axis_name(rng):
    mesh = cpu_mesh((2, 2), ("a", "b"))
    spec = P(None, ("a", "b"))
    q, k, v = _qkv(rng, 2, 32, 4, 2, 64)
    f = jax.shard_map(lambda *x: ring_attention(*x, ("a", "b"), causal=True), mesh=mesh,
                      in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    assert rel_err(jax.jit(f)(q, k, v), _reference(q, k, v, True)) < 1e-5


# ---- log-sum-exp ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_return_lse(rng, layout, causal):
    q, k, v = _qkv(rng, 2, 48, 8, 2, 64)
    out, lse = jax.jit(_sharded(cpu_mesh((3,), ("sp",)), layout, return_lse=True,
                                causal=causal))(q, k, v)
    assert lse.shape == (2, 8, 48) and lse.dtype == jnp.float32
    assert rel_err(out, _reference(q, k, v, causal)) < 1e-5
    assert rel_err(lse, _reference_lse(q, k, v, causal)) < 1e-5


# ---- gradients -----------------------------------------------------------------
@pytest.mark.parametrize("n,layout,causal", [(3, "contiguous", True), (4, "zigzag", True),
                                             (2, "contiguous", False), (3, "zigzag", False)])
def test_gradients(rng, n, layout, causal):
    q, k, v = _qkv(rng, 2, 8 * n, 8, 2, 64)
    w = _normal(rng, q.shape)
    ring = _sharded(cpu_mesh((n,), ("sp",)), layout, causal=causal)
    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * w), (0, 1, 2)))(q, k, v)
    ours = grad(ring)
    refs = grad(lambda *x: _reference(*x, causal))
    for a, b in zip(ours, refs):
        assert np.all(np.isfinite(a))
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("n,layout,causal,hkv", [(1, "zigzag", True, 2), (8, "zigzag", True, 2),
                                                 (8, "contiguous", True, 1),
                                                 (2, "contiguous", False, 4)])
def test_gradients_gqa(rng, n, layout, causal, hkv):
    """dK/dV of a kv head sum over its query heads, on rings of 1 to 8."""
    q, k, v = _qkv(rng, 1, 8 * n, 8, hkv, 32)
    w = _normal(rng, q.shape)
    ring = _sharded(cpu_mesh((n,), ("sp",)), layout, causal=causal)
    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * w), (0, 1, 2)))(q, k, v)
    for a, b in zip(grad(ring), grad(lambda *x: _reference(*x, causal))):
        assert rel_err(a, b) < 1e-4


def test_backward_is_a_ring():
    """The gradient moves blocks with ppermute (collective-permute) and never
    gathers the sequence: its memory stays one block per device."""
    n = 4
    g = jax.ShapeDtypeStruct((1, 8 * n, 4, 32), jnp.float32)
    # shard_map alone: the zigzag reordering of global arrays would add its own
    # collectives outside the op.
    ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "sp", causal=True,
                                                        layout="zigzag"),
                         mesh=cpu_mesh((n,), ("sp",)), in_specs=(SEQ,) * 3, out_specs=SEQ,
                         check_vma=False)
    loss = lambda q, k, v: jnp.sum(ring(q, k, v) ** 2)
    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(g, g, g).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-reduce" not in hlo


def test_training_tracks_plain_attention(rng):
    """A one-layer attention model trained with ring attention follows the
    loss curve of the same model with plain attention: from the same
    parameters every step's loss and gradients agree to float32 rounding
    (along plain attention's trajectory), and trained apart the two curves
    stay within 1% (at this learning rate the rounding differences grow over
    30 steps: up to 4e-3 relative was seen from fresh inputs)."""
    n, s, h, d = 4, 32, 4, 16
    x = _normal(rng, (2, s, h * d))
    y = _normal(rng, (2, s, h * d))
    params = {name: _normal(rng, (h * d, h * d)) * 0.2 for name in ("wq", "wk", "wv", "wo")}
    ring = _sharded(cpu_mesh((n,), ("sp",)), "zigzag", causal=True)

    def loss(p, attend):
        q, k, v = ((x @ p[w]).reshape(2, s, h, d) for w in ("wq", "wk", "wv"))
        return jnp.mean((attend(q, k, v).reshape(2, s, h * d) @ p["wo"] - y) ** 2)

    # one compiled value-and-gradient each (an un-jitted shard_map re-traces every call)
    ours = jax.jit(jax.value_and_grad(lambda p: loss(p, ring)))
    plain = jax.jit(jax.value_and_grad(
        lambda p: loss(p, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))))
    update = lambda p, grads: jax.tree.map(lambda a, b: a - 0.5 * b, p, grads)

    def train(step):
        p, losses = params, []
        for _ in range(30):
            value, grads = step(p)
            losses.append(float(value))
            p = update(p, grads)
        return np.array(losses)

    p = params
    for _ in range(30):  # in lockstep, along plain attention's trajectory
        (a, ga), (b, gb) = ours(p), plain(p)
        np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
        for name in ga:
            assert rel_err(ga[name], gb[name]) < 1e-4, name
        p = update(p, gb)
    curve = train(ours)
    assert curve[-1] < 0.8 * curve[0], curve  # it learns
    np.testing.assert_allclose(curve, train(plain), rtol=1e-2)


def test_lse_gradient(rng):
    q, k, v = _qkv(rng, 1, 24, 4, 2, 64)
    ring = _sharded(cpu_mesh((3,), ("sp",)), "zigzag", return_lse=True, causal=True)
    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x)[1] ** 2), (0, 1)))(q, k, v)
    ref = lambda *x: (None, _reference_lse(*x, True))
    for a, b in zip(grad(ring), grad(ref)):
        assert rel_err(a, b) < 1e-4


def test_fully_masked_block_is_finite(rng):
    """A block that hides every key from every query leaves the state empty
    (no NaN in values or gradients), and an empty state finishes to zeros."""
    q5, k = _normal(rng, (1, 8, 2, 2, 64)), _normal(rng, (1, 8, 2, 64))
    q_pos, k_pos = jnp.arange(8), jnp.arange(8, 16)

    def run(q5, k):
        state = reference._block_update(reference._init_state(q5), q5, k, k, q_pos, k_pos,
                                        True, 0.125)
        return reference._finish(state, (1, 8, 4, 64), jnp.float32)

    out, lse = jax.jit(run)(q5, k)
    assert np.all(np.asarray(out) == 0) and np.all(np.isfinite(lse))
    grads = jax.jit(jax.grad(lambda *x: jnp.sum(run(*x)[0]) + jnp.sum(run(*x)[1]), (0, 1)))(
        q5, k)
    assert all(np.all(np.isfinite(g)) for g in grads)


# ---- inside lax.scan -----------------------------------------------------------
def test_repeated_calls_in_scan(rng):
    n, layers = 4, 3
    q, k, v = _qkv(rng, 2, 8 * n, 4, 2, 64)
    mesh = cpu_mesh((n,), ("sp",))

    def stacked(x, kk, vv):
        return lax.scan(lambda c, _: (ring_attention(c, kk, vv, "sp", causal=True,
                                                     layout="zigzag") * 2.0, None),
                        x, None, length=layers)[0]

    f = jax.jit(jax.shard_map(stacked, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ,
                              check_vma=False))
    out = zigzag_unshard(f(*(zigzag_shard(x, n) for x in (q, k, v))), n)
    ref = q
    for _ in range(layers):
        ref = _reference(ref, k, v, True) * 2.0
    assert rel_err(out, ref) < 1e-5


# ---- zigzag reordering ---------------------------------------------------------
@pytest.mark.parametrize("shape,seq_axis", [((24,), 0), ((2, 24, 3), 1), ((2, 3, 24), -1),
                                            ((24, 5), 0)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_zigzag_round_trip(rng, shape, seq_axis, n):
    x = _normal(rng, shape)
    z = zigzag_shard(x, n, seq_axis=seq_axis)
    assert z.shape == x.shape
    np.testing.assert_array_equal(zigzag_unshard(z, n, seq_axis=seq_axis), x)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_layout(n):
    chunk = 3
    z = np.asarray(zigzag_shard(jnp.arange(2 * n * chunk), n, seq_axis=0)).reshape(n, 2, chunk)
    for r in range(n):
        np.testing.assert_array_equal(z[r, 0], np.arange(r * chunk, (r + 1) * chunk))
        c = 2 * n - 1 - r
        np.testing.assert_array_equal(z[r, 1], np.arange(c * chunk, (c + 1) * chunk))


@pytest.mark.parametrize("sharding_mode", ["explicit"], indirect=True)
@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (3, 3), (2, 4)])
def test_zigzag_keeps_a_sharded_sequence_sharded(rng, sharding_mode, n, m):
    """On an Explicit mesh a sequence sharded over m devices is reordered
    where it lies (collective permutes, no all-gather when m == n) and keeps
    its sharding; the values are those of the unsharded reorder."""
    mesh = cpu_mesh((m,), ("sp",))
    x = rng.standard_normal((2, 8 * n * m, 3)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, SEQ))
    for fn, inverse in ((zigzag_shard, zigzag_unshard), (zigzag_unshard, zigzag_shard)):
        f = jax.jit(lambda a: fn(a, n))
        y = f(xs)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(fn(x, n)))
        assert y.sharding.is_equivalent_to(xs.sharding, 3), y.sharding
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: inverse(a, n))(y)), x)
        if n == m:
            hlo = f.lower(xs).compile().as_text()
            assert "collective-permute" in hlo and "all-gather" not in hlo


@pytest.mark.parametrize("kw,match", [
    (dict(axis_size=2), "must divide by 2 \\* axis_size \\(4\\)"),
    (dict(axis_size=0), "axis_size must be a positive int"),
    (dict(axis_size=1, seq_axis=3), "seq_axis=3 out of range"),
])
def test_zigzag_errors(kw, match):
    x = jnp.zeros((2, 6, 4))
    for fn in (zigzag_shard, zigzag_unshard):
        with pytest.raises(ValueError, match=match):
            fn(x, **kw)
        with pytest.raises(TypeError, match="seq_axis must be an int .*1.0"):
            fn(x, 1, seq_axis=1.0)


# ---- input checks --------------------------------------------------------------
def _call(q_shape, k_shape, v_shape=None, dtypes=(jnp.float32,) * 3, **kw):
    mesh = cpu_mesh((2,), ("sp",))
    shapes = (q_shape, k_shape, v_shape or k_shape)
    args = [jnp.zeros(s, d) for s, d in zip(shapes, dtypes)]
    f = jax.shard_map(lambda *x: ring_attention(*x, "sp", **kw), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False)
    return jax.jit(f)(*args)


Q, KV = (2, 16, 8, 64), (2, 16, 2, 64)


@pytest.mark.parametrize("args,kw,exc,match", [
    (((2, 16, 64), KV), {}, ValueError, "q must have rank 4"),
    ((Q, (2, 16, 2, 1, 64)), {}, ValueError, "k must have rank 4"),
    ((Q, KV, (2, 16, 4, 64)), {}, ValueError, "k and v must have the same shape"),
    ((Q, (1, 16, 2, 64)), {}, ValueError, "same batch"),
    ((Q, (2, 8, 2, 64)), {}, ValueError, "same seq_local"),
    ((Q, (2, 16, 2, 32)), {}, ValueError, "same head_dim"),
    ((Q, (2, 16, 3, 64)), {}, ValueError, "query heads \\(8\\) must be a multiple of kv "
                                           "heads \\(3\\)"),
    ((Q, KV), dict(layout="striped"), ValueError, "layout must be one of"),
    ((Q, KV), dict(mechanism="cuda"), ValueError, "mechanism must be one of"),
    ((Q, KV), dict(mechanism="cuda"), ValueError, "'copy_engine', 'ld_st', 'xla'"),
    ((Q, KV), dict(mechanism="ld_st", num_comm_ctas=0), ValueError,
     "num_comm_ctas must be 1..32, got 0"),
    ((Q, KV), dict(mechanism="ld_st", num_comm_ctas=33), ValueError,
     "num_comm_ctas must be 1..32"),
    ((Q, KV), dict(mechanism="ld_st", num_comm_ctas=4.0), TypeError,
     "num_comm_ctas must be an int"),
    ((Q, KV), dict(mechanism="ld_st", num_comm_ctas=True), TypeError,
     "num_comm_ctas must be an int"),
    ((Q, KV), dict(mechanism="copy_engine", num_comm_ctas=8), ValueError,
     "num_comm_ctas applies to mechanism='ld_st'"),
    (((2, 6, 8, 64), (2, 6, 2, 64)), dict(layout="zigzag"), ValueError,
     "needs an even seq_local.*got 3"),
    ((Q, KV), dict(dtypes=(jnp.int32, jnp.float32, jnp.float32)), TypeError,
     "q must be floating point"),
    ((Q, KV), dict(dtypes=(jnp.float32, jnp.float32, jnp.int8)), TypeError,
     "v must be floating point"),
    ((Q, KV), dict(dtypes=(jnp.bfloat16, jnp.float32, jnp.float32)), TypeError,
     "q, k and v must have the same dtype"),
    ((Q, KV), dict(scale="big"), TypeError, "scale must be a real number or None"),
    ((Q, KV), dict(scale=float("inf")), ValueError, "scale must be finite"),
    ((Q, KV), dict(causal="no"), TypeError, "causal must be a bool .*'no'"),
    ((Q, KV), dict(causal=None), TypeError, "causal must be a bool"),
    ((Q, KV), dict(deterministic="yes"), TypeError, "deterministic must be a bool"),
])
def test_bad_inputs(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(*args, **kw)


def test_scale_as_a_jax_scalar_and_traced(rng):
    """A concrete jnp scalar is a scale like a float; a traced one is refused
    with what to do (the scale is compiled into the kernel)."""
    q, k, v = _qkv(rng, 1, 16, 2, 2, 64)
    want = _reference(q, k, v, False, 0.3)
    ring = _sharded(cpu_mesh((2,), ("sp",)), scale=jnp.float32(0.3))
    assert rel_err(jax.jit(ring)(q, k, v), want) < 1e-5
    traced = jax.jit(lambda q, k, v, s: _sharded(cpu_mesh((2,), ("sp",)), scale=s)(q, k, v))
    with pytest.raises(TypeError, match="scale must be a concrete number.*traced"):
        traced(q, k, v, jnp.float32(0.3))


@pytest.mark.parametrize("n", [1, 2])
def test_empty_head_dim_as_jax_nn(rng, n):
    """D = 0: the empty output jax.nn.dot_product_attention gives (not a
    ZeroDivisionError from the default scale), and the log-sum-exp of the
    all-zero scores, log(visible keys)."""
    q = jnp.zeros((1, 4 * n, 2, 0))
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", causal=True, return_lse=True),
                      mesh=cpu_mesh((n,), ("sp",)), in_specs=SEQ,
                      out_specs=(SEQ, P(None, None, "sp")), check_vma=False)
    out, lse = jax.jit(f)(q)
    assert out.shape == q.shape == jax.nn.dot_product_attention(q, q, q, is_causal=True).shape
    np.testing.assert_allclose(np.asarray(lse)[0, 0], np.log(np.arange(1, 4 * n + 1)), rtol=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_empty_local_sequence(layout):
    """No tokens: an empty result (as jax.nn.dot_product_attention), also
    the log-sum-exp and the gradients."""
    q = jnp.zeros((2, 0, 4, 64))
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", causal=True, layout=layout,
                                               return_lse=True),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=SEQ,
                      out_specs=(SEQ, P(None, None, "sp")), check_vma=False)
    out, lse = jax.jit(f)(q)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    g = jax.jit(jax.grad(lambda q: jnp.sum(f(q)[0])))(q)
    assert g.shape == q.shape
    assert jax.nn.dot_product_attention(q, q, q).shape == out.shape  # the same contract


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_xla_tiny_half_precision(rng, dtype, causal):
    """One rank, mechanism "xla": XLA's attention, whose pinned half-precision
    dot algorithm XLA:CPU cannot compile for tiny dots (B = S = H = 1 in bf16,
    most small fp16 shapes): values and gradients must still come out."""
    q, k, v = _qkv(rng, 1, 1, 1, 1, 64, dtype)
    f = _sharded(cpu_mesh((1,), ("sp",)), causal=causal, mechanism="xla")
    assert rel_err(jax.jit(f)(q, k, v), _reference(q, k, v, causal)) < 2e-2
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2),
                             argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(_reference(*a, causal) ** 2), argnums=(0, 1, 2))(
        *_f32(q, k, v))
    for g, w in zip(grads, want):  # dq = dk = 0 here: one key takes all the weight
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=2e-2, atol=2e-2)


def test_other_mesh_axes_keep_their_varying_type(rng):
    """q sharded over a second axis too (batch over "tp"): the ring state must
    vary like q, or shard_map's type check (check_vma) rejects the scan."""
    mesh = cpu_mesh((2, 2), ("tp", "sp"))
    q = jnp.asarray(rng.standard_normal((4, 16, 2, 8)), jnp.float32)
    f = jax.jit(jax.shard_map(lambda a: ring_attention(a, a, a, "sp", causal=True), mesh=mesh,
                              in_specs=P("tp", "sp"), out_specs=P("tp", "sp")))
    ref = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(np.asarray(f(q)), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ---- the fused path's plumbing (primitive + custom_vjp; CPU lowers it to the ring)
@pytest.mark.parametrize("mechanism,n,kw", [("copy_engine", 2, {}),
                                            ("ld_st", 8, dict(num_comm_ctas=4))])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fused_path_values_and_grads(rng, layout, deterministic, mechanism, n, kw):
    """The fused mechanisms bind the kernel primitive (ld_st with its
    communicator CTA count; on CPU it lowers to the reference ring): values,
    lse and gradients match plain attention, with the backward's block
    gradients as the block-kernel primitive (whose CPU lowering is the
    reference's einsums) or, deterministic, as einsums."""
    s = n * 256
    q, k, v = _qkv(rng, 1, s, 4, 2, 64, jnp.bfloat16)
    ring = _sharded(cpu_mesh((n,), ("sp",)), layout, return_lse=True, causal=True,
                    mechanism=mechanism, deterministic=deterministic, **kw)
    out, lse = jax.jit(ring)(q, k, v)
    assert rel_err(out, _reference(q, k, v, True)) < 2e-2
    assert rel_err(lse, _reference_lse(q, k, v, True)) < 1e-2
    loss = lambda f: (lambda *x: jnp.sum(f(*x)[0].astype(jnp.float32) ** 2))
    ours = jax.jit(jax.grad(loss(ring), (0, 1, 2)))(q, k, v)
    refs = jax.jit(jax.grad(loss(lambda *x: (_reference(*x, True),)), (0, 1, 2)))(q, k, v)
    for a, b in zip(ours, refs):
        assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("mechanism,kw,want", [
    ("ld_st", {}, ("ld_st", 16)), ("ld_st", dict(num_comm_ctas=3), ("ld_st", 3)),
    ("copy_engine", {}, ("copy_engine", 0)), ("auto", {}, ("copy_engine", 0))])
def test_kernel_primitive_params(mechanism, kw, want):
    """The primitive's config carries the resolved mechanism and the
    communicator CTA count (0 unless ld_st); "auto" resolves through
    pk_jax/tuning.py."""
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", mechanism=mechanism, **kw),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=SEQ, out_specs=SEQ,
                      check_vma=False)
    def find(jaxpr):  # the primitive's equations, at any nesting depth
        for e in jaxpr.eqns:
            if e.primitive.name == "pk_ring_attention":
                yield e
            for sub in e.params.values():
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from find(sub)

    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16))
    (eqn,) = find(jaxpr.jaxpr)
    cfg = eqn.params["cfg"]
    assert (cfg.mechanism, cfg.num_comm_ctas) == want


def test_copy_engine_lowers_to_kernel_primitive():
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", mechanism="copy_engine"),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=SEQ, out_specs=SEQ,
                      check_vma=False)
    text = str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)))
    assert "pk_ring_attention" in text
    text = str(jax.make_jaxpr(jax.shard_map(
        lambda q: ring_attention(q, q, q, "sp", mechanism="xla"), mesh=cpu_mesh((2,), ("sp",)),
        in_specs=SEQ, out_specs=SEQ, check_vma=False))(
            jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)))
    assert "pk_ring_attention" not in text and "ppermute" in text
    del q


@pytest.mark.parametrize("mechanism,shape,dtype,what", [
    ("copy_engine", (1, 256, 4, 96), jnp.bfloat16, "head_dim 96"),
    ("copy_engine", (1, 200, 4, 64), jnp.bfloat16, "S_local=200"),
    ("copy_engine", (1, 256, 4, 64), jnp.float32, "dtype float32"),
    ("cudnn", (1, 64, 4, 64), jnp.float32, "dtype float32"),
    ("cudnn", (1, 64, 4, 12), jnp.bfloat16, "head_dim 12"),
    ("cudnn", (1, 64, 4, 264), jnp.bfloat16, "head_dim 264"),
])
def test_forced_mechanism_rejects_unsupported(mechanism, shape, dtype, what):
    """A forced mechanism raises for shapes it does not take, naming the
    mechanism and what is wrong."""
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", mechanism=mechanism),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=SEQ, out_specs=SEQ,
                      check_vma=False)
    glob = jax.ShapeDtypeStruct((shape[0], 2 * shape[1]) + shape[2:], dtype)
    with pytest.raises(ValueError, match=f"mechanism='{mechanism}' does not take {what}"):
        jax.eval_shape(f, glob)


def test_zigzag_chunk_must_fit_tiles():
    """Zigzag needs each half of S_local to be whole 128-row tiles."""
    f = jax.shard_map(lambda q: ring_attention(q, q, q, "sp", layout="zigzag",
                                               mechanism="copy_engine"),
                      mesh=cpu_mesh((2,), ("sp",)), in_specs=SEQ, out_specs=SEQ,
                      check_vma=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((1, 2 * 128, 4, 64), jnp.bfloat16))


# ---- extreme scales and logits (the pure-JAX ring) ------------------------------
def _extreme_case(rng, dtype, case):
    """q, k, v [1, 16, 2, 8] and a scale: huge finite scales on unit logits,
    or huge logits (a few keys far above the rest) at the default scale."""
    q, k, v = (np.asarray(rng.standard_normal((1, 16, 2, 8))) for _ in range(3))
    if case == "huge_logits":
        k[:, rng.integers(16, size=3)] *= 1e15  # scores ~1e30, finite in fp32
        return (*(jnp.asarray(a, dtype) for a in (q, k, v)), None)
    return (*(jnp.asarray(a, dtype) for a in (q, k, v)), {"scale_1e10": 1e10,
                                                           "scale_1e30": 1e30}[case])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["scale_1e10", "scale_1e30", "huge_logits"])
def test_pure_jax_ring_extreme_scales_and_logits(rng, dtype, causal, case):
    """The online softmax stays exact where a score dwarfs the others: every
    exponent is bounded by the running max (no NaN, no inf, no row summing
    to 0), equal to jax.nn.dot_product_attention. n = 4 and zigzag give
    blocks where every key is masked for a query (and, for the first
    blocks of zigzag, rows that have seen nothing yet)."""
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v, scale = _extreme_case(rng, dtype, case)
        want = np.asarray(jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal))
        assert np.all(np.isfinite(want))
        for layout in ("contiguous", "zigzag"):
            ring = _sharded(cpu_mesh((4,), ("sp",)), layout, causal=causal, scale=scale,
                            mechanism="xla")
            got = np.asarray(jax.jit(ring)(q, k, v))
            assert got.dtype == dtype and np.all(np.isfinite(got)), (layout, got)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=layout)


def _grads64(q, k, v, dout, scale, causal):
    """(dq, dk, dv) of sum(attention(q, k, v) * dout) in float64 (numpy):
    the true gradients of the float32 inputs; GQA k/v."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bshd,bthd->bhst", q, kr) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bshd,bthd->bhst", do, vr)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
    groups = lambda x: x.reshape(*k.shape[:3], g, k.shape[3]).sum(3)  # GQA: sum each group
    return (np.einsum("bhst,bthd->bshd", ds, kr), groups(np.einsum("bhst,bshd->bthd", ds, q)),
            groups(np.einsum("bhst,bshd->bthd", p, do)))


def _grad_errors(got, want):
    """Max |error| of each gradient of `got` (dq, dk, dv) against `want`
    (inf where one is NaN)."""
    return [float(np.nan_to_num(np.max(np.abs(np.asarray(a, np.float64) - b)), nan=np.inf))
            for a, b in zip(got, want)]


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def _jax_nn_grads(q, k, v, dout, *, scale, causal):
    """jax.nn.dot_product_attention's (dq, dk, dv) of sum(out * dout) under
    jit: one compile per scale and mask, shared by every test that bounds
    its error by jax.nn's."""
    loss = lambda q, k, v: jnp.sum(
        jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal) * dout)
    return jax.grad(loss, (0, 1, 2))(q, k, v)


def _attention_inputs(rng, causal, scale):
    """q [1, 32, 4, 16], k, v [1, 32, 2, 16] (GQA) and an output gradient,
    normal, q divided by the scale below 1e4 (the scores those of scale 1:
    at scale 100 random normal inputs already have near-ties, whose
    gradients hang on the float32 rounding of the scores, in jax.nn as here,
    so that one run's error against another's is noise); from 1e4 on each
    query 4 x one (visible) unit key plus a little noise, so that its score
    leads the others by about 1 or more: every row's softmax is one-hot in
    float32 and the true dq and dk vanish."""
    normal = lambda *shape: rng.standard_normal(shape)
    q, k, v = normal(1, 32, 4, 16), normal(1, 32, 2, 16), normal(1, 32, 2, 16)
    if scale < 1e4:
        q /= scale
    else:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        key = np.array([rng.integers(0, (i if causal else 31) + 1) for i in range(32)])
        q = 4 * np.repeat(k[:, key], 2, axis=2) + 0.01 * normal(1, 32, 4, 16)
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, normal(1, 32, 4, 16))]


def _as_accurate_as_jax_nn(f, rng, scales, causal, place=lambda a: a):
    """f's float32 gradients at each scale (f(scale)(q, k, v), on the
    inputs `place`d) against the float64 ones: never worse than
    jax.nn.dot_product_attention's (under jit) by more than a factor of 4
    plus 1e-5 of the largest gradient (two roundings of the same math
    differ), and finite (inputs: `_attention_inputs`). From scale 1e4 on
    every row's softmax is one-hot: the true dq and dk vanish, jax.nn's are 0 or NaN, and
    f's must be 0 (before the einsum backward took delta from its own
    probabilities they were about 2e-6 x scale)."""
    for scale in scales:
        q, k, v, dout = _attention_inputs(rng, causal, scale)
        want = _grads64(q, k, v, dout, scale, causal)
        ring = f(scale)
        ours = _grad_errors(jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v) * dout),
                                             (0, 1, 2)))(*(place(a) for a in (q, k, v))), want)
        xla = _grad_errors(_jax_nn_grads(q, k, v, dout, scale=scale, causal=causal), want)
        for name, e, x, w in zip(("dq", "dk", "dv"), ours, xla, want):
            bound = 1e-5 * np.max(np.abs(w)) + (4 * x if np.isfinite(x) else 0.0)
            assert e <= bound, (scale, name, e, x)


LARGE_SCALES = (1e4, 1e6, 1e10)


@pytest.mark.parametrize("mechanism", ["xla", "auto"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_at_large_scales_against_float64(rng, mechanism, deterministic, causal):
    """The pure-JAX ring's backward at scales 1e4..1e10 (a ring of 4, GQA),
    as accurate as jax.nn's: the probabilities recomputed from the
    forward's running max and sum, delta from those probabilities."""
    ring = lambda scale: _sharded(cpu_mesh((4,), ("sp",)), "zigzag" if causal else "contiguous",
                                  causal=causal, scale=scale, mechanism=mechanism,
                                  deterministic=deterministic)
    _as_accurate_as_jax_nn(ring, rng, LARGE_SCALES, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_at_ordinary_scales_and_with_lse_against_float64(rng, causal):
    """At scales 1 and 100 the same bound (no accuracy traded for the large
    scales), also with return_lse (whose cotangent delta subtracts) and on a
    ring of one (the ring, not jax.nn, with return_lse)."""
    for n in (1, 4):
        ring = lambda scale: (lambda *x: _sharded(cpu_mesh((n,), ("sp",)), return_lse=True,
                                                  causal=causal, scale=scale)(*x)[0])
        _as_accurate_as_jax_nn(ring, rng, (1.0, 100.0) + ((1e6,) if n == 1 else ()), causal)


@pytest.mark.parametrize("causal", [False, True])
def test_dot_product_attention_gradients_at_large_scales(rng, causal):
    """pk_jax.dot_product_attention under plain jit with the sequence
    sharded (its ring) at scales 1e4..1e10, as accurate as jax.nn's."""
    mesh = cpu_mesh((4,), ("sp",))
    f = lambda scale: (lambda q, k, v: pk_jax.dot_product_attention(q, k, v, causal=causal,
                                                                    scale=scale))
    _as_accurate_as_jax_nn(f, rng, LARGE_SCALES, causal,
                           place=lambda a: jax.device_put(a, NamedSharding(mesh, SEQ)))


def test_block_update_of_a_row_that_saw_nothing_yet(rng):
    """A block where every key is masked for a query, merged into an empty
    state, then a visible block with a huge scale: the first leaves max -inf
    and sum 0 (no -inf - -inf), the second gives the exact softmax."""
    q5 = _normal(rng, (1, 4, 1, 1, 8))
    k, v = _normal(rng, (1, 4, 1, 8)), _normal(rng, (1, 4, 1, 8))
    q_pos = jnp.arange(4, 8)
    state = reference._block_update(reference._init_state(q5), q5, k, v, q_pos,
                                    jnp.arange(8, 12), True, 1e10)
    assert np.all(np.asarray(state[0]) == -np.inf) and np.all(np.asarray(state[1]) == 0)
    state = reference._block_update(state, q5, k, v, q_pos, jnp.arange(4), True, 1e10)
    out, lse = reference._finish(state, (1, 4, 1, 8), jnp.float32)
    want = jax.nn.dot_product_attention(q5[:, :, :, 0], k, v, scale=1e10)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(lse)))


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("n", [1, 2])
def test_one_device_auto_takes_cudnn_where_available(monkeypatch, rng, head_dim, n):
    """Under `auto`, a ring of one device runs cuDNN's fused attention where
    this process has cuDNN and pk_jax/tuning.py's single_gpu_attention
    chooses it (forced here); rings of two or more, return_lse,
    deterministic=True and forced mechanisms do not. cuDNN itself is stood
    in for by XLA's attention here (CPU)."""
    from pk_jax import _compat
    calls = []

    def fake(q, k, v, *, scale, is_causal):
        calls.append(q.shape)
        return _compat.xla_attention(q, k, v, scale=scale, is_causal=is_causal)
    monkeypatch.setattr(_compat, "cudnn_available", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_attention", fake)
    # rings of two at head dim 256 would take cuDNN's block backward, whose
    # CUDA branch cannot be traced here (test_auto_takes_the_cudnn_ring)
    monkeypatch.setattr(_compat, "cudnn_blocks_available", lambda: False)
    mesh = cpu_mesh((n,), ("sp",))
    q, k, v = (_normal(rng, (1, 128 * n, 2, head_dim), jnp.bfloat16) for _ in range(3))
    for kwargs, used in (({}, n == 1), ({"deterministic": True}, False),
                         ({"mechanism": "xla"}, False)):
        calls.clear()
        f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "sp", causal=True, **kwargs),
                          mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        with tuning.forced(single_gpu_attention="cudnn"):
            out = jax.jit(f)(q, k, v)
        assert bool(calls) == used, kwargs
        want = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)),
                                            is_causal=True)
        assert rel_err(out, want) < 2e-2


@pytest.mark.parametrize("choice", tuning.SINGLE_GPU_ATTENTION_CHOICES)
@pytest.mark.parametrize("causal", [False, True])
def test_one_device_auto_runs_the_measured_choice(monkeypatch, rng, choice, causal):
    """Each of single_gpu_attention's choices runs what it names on a ring of
    one device: cuDNN's whole attention ("cudnn"), pk's kernel and block
    backward ("kernel"), or the kernel's forward with cuDNN's backward steps
    ("kernel_fwd_cudnn_bwd"); output and gradients match fp32 attention.
    cuDNN's attention is stood in for by XLA's, its backward steps by the
    ring's einsum steps (CPU)."""
    from pk_jax import _compat
    from pk_jax.ops.ring_attention import cudnn as ring_attention_cudnn
    whole, steps = [], []

    def fake(q, k, v, *, scale, is_causal):
        whole.append(q.shape)
        return _compat.xla_attention(q, k, v, scale=scale, is_causal=is_causal)

    def fake_steps(cfg, *args):
        steps.append(cfg.block_grads)
        return None  # the ring's default steps: einsums under block_grads "cudnn"
    monkeypatch.setattr(_compat, "cudnn_available", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_attention", fake)
    monkeypatch.setattr(_compat, "cudnn_blocks_available", lambda: True)
    monkeypatch.setattr(ring_attention_cudnn, "block_grads", fake_steps)
    mesh = cpu_mesh((1,), ("sp",))
    q, k, v = (_normal(rng, (1, 256, 4, 64), jnp.bfloat16) for _ in range(3))
    w = _normal(rng, q.shape)
    f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "sp", causal=causal),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w)
    with tuning.forced(single_gpu_attention=choice):
        out = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
    assert bool(whole) == (choice == "cudnn")
    assert steps == (["cudnn"] if choice == "kernel_fwd_cudnn_bwd" else [])
    assert rel_err(out, _reference(q, k, v, causal)) < 2e-2
    want = jax.grad(loss(lambda *x: _reference(*x, causal)), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, want):
        assert rel_err(a, b) < 3e-2


def test_one_device_choice_reads_the_gqa_group(monkeypatch):
    """ring_attention's one-device choice passes the call's GQA group (query
    heads per K/V head) to the table: under a full mask at head dim 128 a
    group of 4 runs pk's block backward, the same shapes without GQA cuDNN's;
    a causal mask below its range (1024 tokens) keeps cuDNN's whatever the
    group (cuDNN stubbed as present: this process has none)."""
    from pk_jax import _compat
    from pk_jax.ops.ring_attention import api
    monkeypatch.setattr(_compat, "cudnn_available", lambda: True)
    choose = lambda hkv, causal, s=4096: api._single_gpu(
        jax.ShapeDtypeStruct((2, s, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, s, hkv, 128), jnp.bfloat16), 1, "copy_engine", "auto",
        causal, False, False)
    assert choose(8, False) == "kernel"
    assert choose(32, False) == "kernel_fwd_cudnn_bwd"
    assert choose(8, True, s=1024) == "kernel_fwd_cudnn_bwd"
    assert choose(8, True) == choose(32, True) == "kernel"


def test_single_gpu_attention_table():
    """Shapes the kernel takes run its forward, its block backward only in
    SINGLE_GPU_ATTENTION_KERNEL_BWD's ranges (both ends checked); shapes it
    does not take run cuDNN; tuning.forced checks its arguments and restores
    the table."""
    choose = tuning.single_gpu_attention
    for d, causal, group, first, past in tuning.SINGLE_GPU_ATTENTION_KERNEL_BWD:
        assert choose(d, causal, first, True, group=group) == "kernel"
        assert choose(d, causal, past - 128, True, group=2 * group) == "kernel"
        assert choose(d, causal, past + 127, True, group=group) == "kernel_fwd_cudnn_bwd"
        assert choose(d, causal, first - 128, True, group=group) == "kernel_fwd_cudnn_bwd"
        assert choose(d, causal, first, False, group=group) == "cudnn"
        if group > 1:
            assert choose(d, causal, first, True, group=group - 1) == "kernel_fwd_cudnn_bwd"
    # each mask's entry alone: a causal call outside the causal range keeps
    # cuDNN's backward whatever its group, as does a full mask without GQA
    assert choose(128, True, 1024, True, group=8) == "kernel_fwd_cudnn_bwd"
    assert choose(128, False, 8192, True) == "kernel_fwd_cudnn_bwd"
    assert choose(64, True, 8192, True) == "kernel_fwd_cudnn_bwd"
    assert choose(64, False, 4096, True, group=8) == "kernel_fwd_cudnn_bwd"
    assert choose(96, True, 8192, False) == "cudnn"
    with tuning.forced(single_gpu_attention="kernel"):
        assert choose(96, True, 8192, False) == "kernel"
    assert choose(96, True, 8192, False) == "cudnn"
    # checked when called, also without `with` (nothing forced then)
    with pytest.raises(ValueError, match="single_gpu_attention='fastest'; choose from"):
        tuning.forced(single_gpu_attention="fastest")
    with pytest.raises(ValueError, match="'all_gather_mechanism' is not a forcible choice"):
        tuning.forced(all_gather_mechanism="ld_st_ll")
    with pytest.raises(ValueError, match="choose from"):
        with tuning.forced(single_gpu_attention="fastest"):
            pass
    assert choose(96, True, 8192, False) == "cudnn"
    unused = tuning.forced(single_gpu_attention="kernel")  # valid: forces nothing until entered
    assert choose(96, True, 8192, False) == "cudnn"
    with unused:
        assert choose(96, True, 8192, False) == "kernel"
    assert choose(96, True, 8192, False) == "cudnn"


# ---- the ring of cuDNN blocks (mechanism "cudnn"; fp32 einsum blocks on CPU) -------
def _cudnn_ring_case(rng, n, layout, causal, return_lse):
    """bf16 GQA inputs through mechanism="cudnn" (check_vma on): output,
    log-sum-exp and gradients against fp32 attention on the whole sequence."""
    mesh = cpu_mesh((n,), ("sp",))
    q, k, v = _qkv(rng, 2, 16 * n, 4, 2, 32, jnp.bfloat16)
    placed = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v)]  # Explicit needs it
    w = _normal(rng, q.shape)
    ring = _sharded(mesh, layout, return_lse=return_lse, check_vma=True, causal=causal,
                    mechanism="cudnn")
    first = (lambda *x: ring(*x)[0]) if return_lse else ring
    if return_lse:
        assert rel_err(jax.jit(ring)(*placed)[1], _reference_lse(q, k, v, causal)) < 1e-2
    assert rel_err(jax.jit(first)(*placed), _reference(q, k, v, causal)) < 2e-2
    grad = lambda f, args: jax.jit(jax.grad(
        lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w), (0, 1, 2)))(*args)
    for a, b in zip(grad(first, placed), grad(lambda *x: _reference(*x, causal), (q, k, v))):
        assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("n,layout", [(1, "zigzag"), (2, "contiguous"), (3, "contiguous"),
                                      (3, "zigzag"), (4, "zigzag")])
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_ring(rng, n, layout, causal):
    """Every block case of ops/ring_attention/cudnn.py (own block, an earlier
    rank's, a later rank's; whole blocks and zigzag halves) in the forward
    and in the backward's cuDNN-style block gradients (return_lse=False)."""
    _cudnn_ring_case(rng, n, layout, causal, return_lse=False)


@pytest.mark.parametrize("sharding_mode", ["auto", "explicit"], indirect=True)
@pytest.mark.parametrize("n,layout", [(3, "zigzag"), (2, "contiguous")])
def test_cudnn_ring_return_lse(rng, sharding_mode, n, layout):
    """With return_lse the forward is the same ring and the backward's block
    gradients are einsums (cuDNN's backward takes no lse cotangent); on Auto
    and Explicit meshes."""
    _cudnn_ring_case(rng, n, layout, True, return_lse=True)


@pytest.mark.parametrize("chosen", ["cudnn", "copy_engine", "ld_st"])
@pytest.mark.parametrize("deterministic,return_lse,want", [
    (False, False, "cudnn"), (True, False, "einsum"), (False, True, "einsum")])
def test_cudnn_ring_block_grads(monkeypatch, chosen, deterministic, return_lse, want):
    """Block gradients at head dim 256 (the block backward kernel takes 64
    and 128): cuDNN's backward under the cudnn ring and under the forward
    kernel where cuDNN's blocks run, einsums where they do not."""
    from pk_jax import _compat
    from pk_jax.ops.ring_attention import api as ra
    q = jax.ShapeDtypeStruct((1, 256, 4, 256), jnp.bfloat16)
    monkeypatch.setattr(_compat, "cudnn_blocks_available", lambda: True)
    assert ra._block_grads(q, q, "zigzag", chosen, deterministic, return_lse) == want
    if chosen != "cudnn":
        monkeypatch.setattr(_compat, "cudnn_blocks_available", lambda: False)
        assert ra._block_grads(q, q, "zigzag", chosen, deterministic, return_lse) == "einsum"


@pytest.mark.parametrize("head_dim,cudnn_calls", [(96, {"fwd", "bwd"}), (256, {"bwd"}),
                                                  (128, set())])
def test_auto_takes_the_cudnn_ring(monkeypatch, rng, head_dim, cudnn_calls):
    """Under `auto` on a ring of two, shapes the fused kernel does not take
    run the ring of cuDNN blocks where cuDNN's blocks run (stood in for here:
    the CUDA branch is traced, CPU runs the einsum one); head dim 256 keeps
    the fused forward and takes cuDNN's block backward (the block backward
    kernel takes 64 and 128); 128 keeps the kernels."""
    from pk_jax import _compat
    calls = []

    def fake_fwd(q, k, v, *, scale, causal):
        calls.append("fwd")
        return reference.attention_block(q, k, v, causal=causal, scale=scale)

    def fake_bwd(q, k, v, out, lse, dout, *, scale, causal):
        calls.append("bwd")
        delta = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
        pos = lambda x: jnp.arange(x.shape[1])
        return reference.attention_block_grads(q, dout, lse, delta, k, v, pos(q), pos(k),
                                               causal=causal, scale=scale)
    monkeypatch.setattr(_compat, "cudnn_blocks_available", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_block", fake_fwd)
    monkeypatch.setattr(_compat, "cudnn_block_bwd", fake_bwd)
    q, k, v = _qkv(rng, 1, 512, 4, 2, head_dim, jnp.bfloat16)
    ring = _sharded(cpu_mesh((2,), ("sp",)), "zigzag", check_vma=True, causal=True)
    w = _normal(rng, q.shape)
    loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss(ring), (0, 1, 2)))(q, k, v)
    assert set(calls) == cudnn_calls
    for a, b in zip(grads, jax.grad(loss(lambda *x: _reference(*x, True)), (0, 1, 2))(q, k, v)):
        assert rel_err(a, b) < 3e-2
