"""pk_jax's FP8 op on CPU: the references' numerics (what the kernels must
compute), fp8_dot's values and gradients against float32 matmuls, delayed
scaling's amaxes, inside shard_map, and the errors for bad input.

Tolerances. FP8 rounding is relative: e4m3 keeps 3 mantissa bits (a value's
error is at most 2^-4 of it), e5m2 2 bits (2^-3). A dot product of K terms
with independent rounding errors has a relative error of about the per-term
bound / sqrt(3) on average, so the relative Frobenius error of a product of
two e4m3 operands sits near 2 * 2^-4 / sqrt(3) ~ 0.07 at worst and ~0.04 in
practice; with an e5m2 gradient ~0.08. The tests bound the forward at 0.06
(e4m3 x e4m3) and the gradients at 0.10 (e5m2 x e4m3), as Transformer
Engine's FP8 tests bound an FP8 GEMM against its high-precision reference
by the format's epsilon (e4m3 0.125, e5m2 0.25) elementwise; the Frobenius
bounds here are the tighter of the two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from pk_jax.ops.fp8 import primitive as prim
from pk_jax.ops.fp8 import quantize_block_copies

FWD_TOL, GRAD_TOL = 0.06, 0.10


def _inputs(rng, m, k, n, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    return x, w, t


def _f32_grads(x, w, t):
    f = lambda x, w: jnp.sum((x.astype(jnp.float32) @ w.astype(jnp.float32)) * t)
    return jax.grad(f, (0, 1))(x, w)


@pytest.mark.parametrize("granularity", ["tensor", "rows", "cols", "blocks"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_reconstructs(rng, granularity, dtype):
    x = jnp.asarray(rng.standard_normal((200, 300)) * 3, jnp.float32)  # partial blocks
    rowwise = granularity != "cols"
    q, qt, f, amax = pk_jax.fp8_quantize(x, granularity, dtype, rowwise=rowwise,
                                         transposed=granularity != "rows")
    assert f.shape == prim.factors_shape(granularity, 200, 300)
    deq_t = qt.astype(jnp.float32) if qt is not None else None
    if granularity == "tensor":
        deq_t = deq_t * f[0]
        np.testing.assert_allclose(amax, [np.abs(np.asarray(x)).max()])
    elif granularity == "cols":  # qt [C, R] with factors [Rb, C]: per 128 of R
        deq_t = deq_t * jnp.repeat(f.T, 128, axis=1)[:, :200]
    elif granularity == "rows":
        deq_t = None
        assert qt is None
    else:
        deq_t = deq_t * jnp.repeat(jnp.repeat(f, 128, 0), 128, 1)[:200, :300].T
    bound = 2.0 ** -(4 if jnp.dtype(dtype) == prim.E4M3 else 3)
    if q is not None:
        if granularity == "tensor":
            deq = q.astype(jnp.float32) * f[0]
        elif granularity == "rows":
            deq = q.astype(jnp.float32) * jnp.repeat(f.T, 128, axis=1)[:, :300]
        else:
            deq = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(f, 128, 0), 128, 1)[:200, :300]
        err = np.abs(np.asarray(deq - x)) / (np.abs(np.asarray(x)) + 1e-3)
        assert err.max() <= bound * 1.01 + 0.02  # + subnormal range near zero
        assert rel_err(deq, x) < bound
        if deq_t is not None:  # both copies hold the same values
            np.testing.assert_array_equal(np.asarray(qt.T.astype(jnp.float32)),
                                          np.asarray(q.astype(jnp.float32)))
    if deq_t is not None:
        assert rel_err(deq_t.T, x) < bound


@pytest.mark.parametrize("granularity", ["tensor", "rows", "cols", "blocks"])
def test_vanishing_blocks_quantize_to_zeros_not_nan(rng, granularity):
    """A vanishing amax (a confident softmax's gradients) caps the scale at
    2^126: the block's zeros stay zeros (0 * inf would be NaN), the factor
    is 2^-126 and the dequantized values are the input's (to FP8 rounding)."""
    x = (np.sign(rng.standard_normal((256, 384))) * rng.uniform(1, 2, (256, 384))).astype(
        np.float32) * 1e-37
    x[::3] = 0.0
    q, qt, f, _ = pk_jax.fp8_quantize(jnp.asarray(x), granularity, jnp.float8_e4m3fn,
                                      rowwise=granularity != "cols",
                                      transposed=granularity != "rows")
    for a in (q, qt, f):
        if a is not None and a.size:
            assert np.isfinite(np.asarray(a, np.float32)).all()
    f = np.asarray(f)  # 2^-126, and 1 for a block of zeros only (every third row)
    assert np.isin(f, np.float32([2.0 ** -126, 1.0])).all() and (f < 1).any()
    if granularity == "tensor":
        back = np.asarray(q, np.float32) * np.float64(2.0 ** -126)
        np.testing.assert_allclose(back, x, rtol=0.07)


def test_quantize_scale_definitions():
    # the largest |x| of a block lands on the format's largest finite value
    x = jnp.array([[1.0, -3.0, 0.5, 2.0]], jnp.float32)
    q, _, f, amax = pk_jax.fp8_quantize(x, "tensor")
    assert float(amax[0]) == 3.0 and float(f[0]) == pytest.approx(3.0 / 448)
    assert float(q[0, 1]) == -448.0
    # an all-zero block has factor 1 and zeros
    q, _, f, _ = pk_jax.fp8_quantize(jnp.zeros((2, 256), jnp.float32), "rows")
    np.testing.assert_array_equal(f, np.ones((2, 2)))
    assert not np.any(np.asarray(q.astype(jnp.float32)))
    # a given scale (delayed scaling) saturates instead of overflowing
    q, _, f, amax = pk_jax.fp8_quantize(x, "tensor", scale=jnp.float32(448.0))
    assert float(q[0, 1]) == -448.0 and float(q[0, 0]) == 448.0 and float(amax[0]) == 3.0
    assert float(f[0]) == pytest.approx(1 / 448)
    # margin halves the scale per unit
    _, _, f1, _ = pk_jax.fp8_quantize(x, "tensor", margin=1.0)
    assert float(f1[0]) == pytest.approx(2 * 3.0 / 448)
    # NaN in a block propagates to its factor (never a silent finite value)
    y = x.at[0, 2].set(jnp.nan)
    _, _, f, amax = pk_jax.fp8_quantize(y, "tensor")
    assert np.isnan(np.asarray(amax)).all() and not np.isfinite(np.asarray(f)).all()


@pytest.mark.parametrize("recipe", ["current", "block",
                                    pk_jax.Fp8Recipe("block", wgrad_dy_blocks=True)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_dot_values_and_gradients(rng, recipe, dtype):
    x, w, t = _inputs(rng, 256, 384, 256, dtype)
    y = jax.jit(lambda x, w: pk_jax.fp8_dot(x, w, recipe))(x, w)
    assert y.dtype == dtype and y.shape == (256, 256)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(y, want) < FWD_TOL
    loss = lambda x, w: jnp.sum(pk_jax.fp8_dot(x, w, recipe).astype(jnp.float32) * t)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    assert dx.dtype == dtype and dw.dtype == dtype
    gx, gw = _f32_grads(x, w, t)
    assert rel_err(dx, gx) < GRAD_TOL and rel_err(dw, gw) < GRAD_TOL


def test_fp8_dot_matches_its_pieces(rng):
    """The op is the documented composition: quantize, then the scaled GEMM."""
    x, w, _ = _inputs(rng, 128, 256, 128)
    xq, _, fx, _ = pk_jax.fp8_quantize(x, "tensor")
    _, wt, fw, _ = pk_jax.fp8_quantize(w, "tensor", rowwise=False, transposed=True)
    want = pk_jax.fp8_matmul(xq, wt, fx, fw)
    np.testing.assert_array_equal(np.asarray(pk_jax.fp8_dot(x, w), np.float32),
                                  np.asarray(want, np.float32))


def test_fp8_dot_leading_dims(rng):
    x = jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 64)) / 12, jnp.bfloat16)
    y = pk_jax.fp8_dot(x, w)
    assert y.shape == (2, 64, 64)
    assert rel_err(y, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL


def test_delayed_scaling_amaxes_and_dy_amax(rng):
    x, w, t = _inputs(rng, 128, 128, 128)
    scales = (jnp.float32(448 / 4), jnp.float32(448 / 0.5), jnp.float32(57344 / 4))
    (y, (ax, aw)) = pk_jax.fp8_dot(x, w, "delayed", scales=scales)
    assert float(ax[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert float(aw[0]) == float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    assert rel_err(y, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL

    def loss(x, w, s):
        return jnp.sum(pk_jax.fp8_dot(x, w, "delayed", scales=s)[0].astype(jnp.float32) * t)
    dx, dw, ds = jax.grad(loss, (0, 1, 2))(x, w, scales)
    # the dy scale's cotangent carries amax(dy) (dy = t here)
    assert float(ds[2]) == pytest.approx(float(jnp.max(jnp.abs(t.astype(jnp.bfloat16)
                                                               .astype(jnp.float32)))))
    assert float(ds[0]) == 0.0 and float(ds[1]) == 0.0
    gx, gw = _f32_grads(x, w, t)
    assert rel_err(dx, gx) < GRAD_TOL and rel_err(dw, gw) < GRAD_TOL


def test_fp8_dot_inside_shard_map(rng, sharding_mode):
    x, w, _ = _inputs(rng, 8 * 32, 128, 128)
    mesh = cpu_mesh((8,), ("x",))
    f = jax.jit(jax.shard_map(lambda x, w: pk_jax.fp8_dot(x, w), mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x")))
    y = f(jax.device_put(x, NamedSharding(mesh, P("x"))), jax.device_put(w, NamedSharding(mesh, P())))
    want = np.concatenate([np.asarray(pk_jax.fp8_dot(x[i * 32:(i + 1) * 32], w), np.float32)
                           for i in range(8)])
    np.testing.assert_array_equal(np.asarray(y, np.float32), want)  # per-shard scales


def test_plain_jit_on_sharded_operands_types_its_results(rng, sharding_mode):
    """Plain jit on operands sharded over a mesh (no shard_map): the
    quantizer's results of another rank than x (the one-element amax) carry
    a sharding spec as long as their rank (jax 0.11 refuses any other), and
    fp8_dot's values equal the one-device call's."""
    x, w, _ = _inputs(rng, 8 * 32, 128, 128)
    mesh = cpu_mesh((8,), ("x",))
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    q, _, factors, amax = jax.jit(lambda x: pk_jax.fp8_quantize(x, "tensor"))(xs)
    for a in (q, factors, amax):
        spec = jax.typeof(a).sharding.spec
        assert len(spec) in (0, a.ndim), (a.shape, spec)
    assert float(amax[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    y = jax.jit(lambda x, w: pk_jax.fp8_dot(x, w, "current"))(xs, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(pk_jax.fp8_dot(x, w, "current"), np.float32))


def test_delayed_scaling_inside_shard_map(rng, sharding_mode):
    """Replicated scales, rows sharded: the amaxes (and dy's, the scales'
    cotangent) are the maxima over every device, replicated like the scales."""
    x, w, t = _inputs(rng, 8 * 32, 128, 128)
    t = t.astype(jnp.bfloat16).astype(jnp.float32)  # dy in bf16 (XLA may skip the rounding)
    mesh = cpu_mesh((8,), ("x",))
    scales = (jnp.float32(100.0), jnp.float32(800.0), jnp.float32(10000.0))

    @jax.shard_map(mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P()))
    def f(x, w, s):
        return pk_jax.fp8_dot(x, w, "delayed", scales=s)

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("x")), put(w, P()), scales)
    _, (ax, aw) = jax.jit(f)(*args)
    amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))
    assert float(ax[0]) == amax(x) and float(aw[0]) == amax(w)
    ds = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * t), 2))(*args)
    assert float(ds[2]) == amax(t) and float(ds[0]) == 0.0


def test_fp8_matmul_reference_block_layouts(rng):
    """Block factors in the layouts fp8.h / gemm.h document: dequantized
    operands multiply to what the GEMM returns."""
    a = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)  # [N, K]
    aq, _, fa, _ = pk_jax.fp8_quantize(a, "rows")
    _, bqt, fb, _ = pk_jax.fp8_quantize(b.T, "blocks", rowwise=False, transposed=True)
    got = pk_jax.fp8_matmul(aq, bqt, fa, fb, scaling="block", out_dtype=jnp.float32)
    deq_a = aq.astype(jnp.float32) * jnp.repeat(fa.T, 128, 1)
    deq_b = bqt.astype(jnp.float32) * jnp.repeat(jnp.repeat(fb, 128, 0), 128, 1).T
    np.testing.assert_allclose(got, deq_a @ deq_b.T, rtol=1e-5, atol=1e-4)
    assert rel_err(got, a @ b.T) < FWD_TOL


# whole tiles in 1, 2, 4 groups; groups of 100 rows (not whole tiles) with a partial
# column tile
@pytest.mark.parametrize("shape,groups", [((512, 384), 1), ((512, 384), 2), ((512, 384), 4),
                                          ((300, 200), 3)])
def test_quantize_row_groups(rng, shape, groups):
    """fp8_quantize(x, "rows", row_groups=g): q as without groups, factors
    [g * ceil(C/128), R / g] whose group i (rows i * ceil(C/128)..) is the
    factors of quantizing group i's rows alone; group_rows and ungroup_rows
    map the plain layout to this one and back."""
    r, c = shape
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 10), jnp.bfloat16)
    q, _, f, _ = pk_jax.fp8_quantize(x, "rows", row_groups=groups)
    plain_q, _, plain, _ = pk_jax.fp8_quantize(x, "rows")
    kb, gm = prim.blocks(c), r // groups
    assert f.shape == (groups * kb, gm)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(plain_q, np.float32))
    for i in range(groups):
        _, _, alone, _ = pk_jax.fp8_quantize(x[i * gm:(i + 1) * gm], "rows")
        np.testing.assert_array_equal(np.asarray(f[i * kb:(i + 1) * kb]), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(prim.ungroup_rows(f, groups)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(prim.group_rows(plain, groups)), np.asarray(f))


# whole tiles (in two row groups), partial tiles
@pytest.mark.parametrize("shape,groups", [((512, 384), 1), ((512, 384), 2), ((300, 200), 1)])
@pytest.mark.parametrize("transposed_blocks", [False, True])
def test_block_copies_in_one_pass(rng, shape, groups, transposed_blocks):
    """quantize_block_copies (one kernel: granularity rows_cols or
    rows_blocks) gives the values of fp8_quantize's "rows" (with the row
    groups) and "cols" / "blocks" calls, each copy with its own factors."""
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 10), jnp.bfloat16)
    got = quantize_block_copies(x, jnp.float8_e5m2, transposed_blocks=transposed_blocks,
                                row_groups=groups)
    q, _, fq, _ = pk_jax.fp8_quantize(x, "rows", jnp.float8_e5m2, row_groups=groups)
    _, qt, fqt, _ = pk_jax.fp8_quantize(x, "blocks" if transposed_blocks else "cols",
                                        jnp.float8_e5m2, rowwise=False, transposed=True)
    for name, g, w in zip(("q", "qt", "factors of q", "factors of qt"), got, (q, qt, fq, fqt)):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=name)
    with pytest.raises(ValueError, match="row_groups=7"):
        quantize_block_copies(x, row_groups=7)


@pytest.mark.parametrize("call,err,match", [
    (lambda x, w: pk_jax.fp8_dot(x, w, "nope"), ValueError, "scaling"),
    (lambda x, w: pk_jax.fp8_dot(x, w, 3), TypeError, "recipe"),
    (lambda x, w: pk_jax.fp8_dot(x[:, :120], w[:120]), ValueError, "K"),
    (lambda x, w: pk_jax.fp8_dot(x, w[:, :120]), ValueError, "N"),
    (lambda x, w: pk_jax.fp8_dot(x[:120], w), ValueError, "rows"),
    (lambda x, w: pk_jax.fp8_dot(x, w[:, :192], "block"), ValueError, "multiple of 128"),
    (lambda x, w: pk_jax.fp8_dot(x, w, "delayed"), ValueError, "scales"),
    (lambda x, w: pk_jax.fp8_dot(x, w, scales=(1.0, 1.0, 1.0)), ValueError, "delayed"),
    (lambda x, w: pk_jax.fp8_dot(x.astype(jnp.int32), w), TypeError, "bfloat16"),
    (lambda x, w: pk_jax.fp8_dot(x, w[:, :128].T), ValueError, "expected"),
    (lambda x, w: pk_jax.fp8_quantize(x, "cols"), ValueError, "transposed"),
    (lambda x, w: pk_jax.fp8_quantize(x, "rows_cols"), ValueError, "expected one of"),
    (lambda x, w: pk_jax.fp8_quantize(x, "rows", scale=1.0), ValueError, "tensor"),
    (lambda x, w: pk_jax.fp8_quantize(x, "rows", transposed=True), ValueError, "cols"),
    (lambda x, w: pk_jax.fp8_quantize(x, "tensor", jnp.bfloat16), TypeError, "float8"),
    (lambda x, w: pk_jax.fp8_quantize(x, "tensor", margin=float("nan")), ValueError,
     "margin"),
    (lambda x, w: pk_jax.fp8_quantize(x[None], "tensor"), ValueError, "2-D"),
    (lambda x, w: pk_jax.fp8_quantize(x, "rows", row_groups=3), ValueError,
     "row_groups=3.*dividing the rows of x \\(128\\)"),
    (lambda x, w: pk_jax.fp8_quantize(x, "rows", row_groups=0), ValueError, "row_groups=0"),
    (lambda x, w: pk_jax.fp8_quantize(x, "blocks", row_groups=2), ValueError,
     "needs granularity='rows'"),
    (lambda x, w: pk_jax.fp8_matmul(x, w, 1.0, 1.0), TypeError, "float8"),
])
def test_bad_input_is_refused(rng, call, err, match):
    x, w, _ = _inputs(rng, 128, 256, 256)
    with pytest.raises(err, match=match):
        call(x, w)


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan"), 0.0, -1.0, 1e39,
                                 np.float32("inf"), np.array([np.inf])])
def test_a_host_scale_that_is_not_finite_and_positive_is_refused(rng, bad):
    """Python and NumPy scales: a ValueError naming the argument (an
    infinite scale saturates every value and dequantizes to zeros)."""
    x, w, _ = _inputs(rng, 128, 256, 256)
    want = "must be a finite number > 0 \\(a float32\\), got "
    with pytest.raises(ValueError, match="fp8_quantize: scale " + want):
        pk_jax.fp8_quantize(x, scale=bad)
    for i, name in enumerate(("x_scale", "w_scale", "dy_scale")):
        scales = tuple(bad if j == i else 1.0 for j in range(3))
        with pytest.raises(ValueError, match=f"fp8_dot: scales's {name} " + want):
            pk_jax.fp8_dot(x, w, "delayed", scales=scales)


def test_an_infinite_traced_scale_gives_nan_never_zeros(rng):
    """A scale in a jax array (traced, or not) that is +-inf: what it scales
    is NaN (as for a scale of 0 or NaN), not the zeros of a saturated value
    times factor 1 / inf; the finite scales of the same calls are exact."""
    x, w, t = _inputs(rng, 128, 256, 256)
    inf, one = jnp.float32(jnp.inf), jnp.float32(1.0)
    quant = jax.jit(lambda x, s: pk_jax.fp8_quantize(x, scale=s))
    for s in (inf, -inf, jnp.float32(0.0), jnp.float32(jnp.nan)):
        q, _, f, _ = quant(x, s)
        assert np.isnan(np.asarray(q.astype(jnp.float32) * f)).all(), s
    q, _, f, _ = quant(x, jnp.float32(448 / 4))
    assert np.isfinite(np.asarray(q.astype(jnp.float32) * f)).all()

    def grads(scales):
        loss = lambda x, w, s: jnp.sum(pk_jax.fp8_dot(x, w, "delayed", scales=s)[0]
                                       .astype(jnp.float32) * t)
        y = jax.jit(lambda x, w, s: pk_jax.fp8_dot(x, w, "delayed", scales=s)[0])(x, w, scales)
        return (y, *jax.jit(jax.grad(loss, (0, 1)))(x, w, scales))

    nan = lambda a: np.isnan(np.asarray(a, np.float32)).all()
    y, dx, dw = grads((inf, one, one))       # x's scale: y and the weight gradient
    assert nan(y) and nan(dw) and not np.isnan(np.asarray(dx, np.float32)).any()
    y, dx, dw = grads((one, inf, one))       # w's: y and the input gradient
    assert nan(y) and nan(dx) and not np.isnan(np.asarray(dw, np.float32)).any()
    y, dx, dw = grads((one, one, inf))       # dy's: both gradients
    assert nan(dx) and nan(dw) and not np.isnan(np.asarray(y, np.float32)).any()
    y = pk_jax.fp8_dot(x, w, "delayed", scales=(inf, one, one))[0]  # eager jax arrays too
    assert nan(y)


def test_bad_dtypes_and_scale_shapes_are_named(rng):
    x, w, _ = _inputs(rng, 128, 256, 256)
    with pytest.raises(TypeError, match="pk_jax.fp8_quantize: dtype must be float8_e4m3fn or "
                       "float8_e5m2, got 'e4m3'"):
        pk_jax.fp8_quantize(x, dtype="e4m3")
    with pytest.raises(TypeError, match="pk_jax.fp8_dot: out_dtype must be bfloat16, float16 or "
                       "float32, got 'nope'"):
        pk_jax.fp8_dot(x, w, out_dtype="nope")
    with pytest.raises(TypeError, match="pk_jax.fp8_matmul: out_dtype must be bfloat16 or "
                       "float32, got 'nope'"):
        q = x.astype(jnp.float8_e4m3fn)
        pk_jax.fp8_matmul(q, q, 1.0, 1.0, out_dtype="nope")
    with pytest.raises(ValueError, match="fp8_quantize: scale must be one float \\(shape \\(\\) "
                       "or \\(1,\\)\\), got shape \\(3,\\)"):
        pk_jax.fp8_quantize(x, scale=np.ones(3))
    with pytest.raises(NameError, match="pk_jax.quantize_activation: axis_name 'x' is not an "
                       "axis bound here.*inside jax.shard_map over a mesh with axis 'x'"):
        pk_jax.quantize_activation(x, axis_name="x")
    # the same arguments, valid, are taken
    assert pk_jax.fp8_quantize(x, dtype="float8_e5m2")[0].dtype == jnp.float8_e5m2
    assert pk_jax.fp8_dot(x, w, out_dtype="float32").dtype == jnp.float32
    q, _, f, _ = pk_jax.fp8_quantize(x, scale=np.ones(1, np.float32) * 100)
    assert float(f[0]) == pytest.approx(0.01)


def test_fp8_matmul_bad_factors(rng):
    a = jnp.zeros((128, 256), jnp.float8_e4m3fn) + jnp.float8_e4m3fn(1)
    with pytest.raises(ValueError, match="scale_a"):
        pk_jax.fp8_matmul(a, a, jnp.ones((3,)), jnp.ones(()), scaling="tensor")
    with pytest.raises(ValueError, match="expected scale_a"):
        pk_jax.fp8_matmul(a, a, jnp.ones((2, 128)), jnp.ones((2, 2)), scaling="block")
    with pytest.raises(TypeError, match="not both"):
        b = a.astype(jnp.float8_e5m2)
        pk_jax.fp8_matmul(b, b, jnp.ones(()), jnp.ones(()))
    with pytest.raises(ValueError, match="K=100"):
        pk_jax.fp8_matmul(a[:, :100], a[:, :100], jnp.ones(()), jnp.ones(()))


def test_recipe_validation():
    with pytest.raises(ValueError, match="margin"):
        pk_jax.Fp8Recipe(margin=-1)
    with pytest.raises(ValueError, match="amax_history_len"):
        pk_jax.Fp8Recipe(amax_history_len=True)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        pk_jax.Fp8Recipe(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="fast_gradient_accumulation=1"):
        pk_jax.Fp8Recipe(fast_gradient_accumulation=1)
    with pytest.raises(ValueError, match="'current' and 'delayed'"):
        pk_jax.Fp8Recipe("block", fast_gradient_accumulation=True)
    with pytest.raises(ValueError, match="wgrad_dy_blocks=True"):
        pk_jax.Fp8Recipe("current", wgrad_dy_blocks=True)
    with pytest.raises(ValueError, match="wgrad_dy_blocks=1"):
        pk_jax.Fp8Recipe("block", wgrad_dy_blocks=1)
    assert pk_jax.Fp8Recipe("block").wgrad_row_blocks
    assert not pk_jax.Fp8Recipe("block", wgrad_dy_blocks=True).wgrad_row_blocks
    r = pk_jax.Fp8Recipe("block")
    assert r.fwd_dtype == jnp.float8_e4m3fn and r.bwd_dtype == jnp.float8_e4m3fn
    assert pk_jax.Fp8Recipe().bwd_dtype == jnp.float8_e5m2
    assert not pk_jax.Fp8Recipe("delayed").fast_gradient_accumulation


def test_fp8_matmul_fast_accum_is_checked(rng):
    a = jnp.asarray(rng.standard_normal((16, 128)), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="fast_accum='yes'"):
        pk_jax.fp8_matmul(a, a, jnp.ones(()), jnp.ones(()), fast_accum="yes")
    f = jnp.ones((1, 16), jnp.float32)
    with pytest.raises(ValueError, match="fast_accum=True.*scaling='tensor'"):
        pk_jax.fp8_matmul(a, a, f, f, scaling="block", b_row_blocks=True, fast_accum=True)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fast_gradient_accumulation_matches_the_reference(rng, recipe):
    """The recipe's fast gradient accumulation changes only how the GPU
    kernels accumulate: off CUDA the values and gradients are the default
    recipe's bit for bit."""
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 32)) / np.sqrt(128), jnp.bfloat16)
    scales = (jnp.float32(100.0), jnp.float32(200.0), jnp.float32(1000.0)) \
        if recipe == "delayed" else None

    def grads(r):
        def loss(x, w):
            y = pk_jax.fp8_dot(x, w, r, scales=scales)
            y = y[0] if scales is not None else y
            return jnp.sum(y.astype(jnp.float32) * jnp.arange(32.0))
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)

    fast = grads(pk_jax.Fp8Recipe(recipe, fast_gradient_accumulation=True))
    plain = grads(pk_jax.Fp8Recipe(recipe))
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_forward_alone_quantizes_no_backward_copies(rng, recipe):
    """fp8_dot not differentiated (inference) quantizes only what its GEMM
    reads: x row-wise and w transposed; differentiated, the forward also
    keeps x^T (weight gradient) and w row-wise (input gradient)."""
    x, w = _inputs(rng, 128, 256, 256)[:2]

    def copies(f, *args):  # (rowwise, transposed) of each quantization, x's first
        eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
        found = []
        def walk(eqns):
            for e in eqns:
                if e.primitive.name == "pk_fp8_quantize":
                    found.append((e.params["rowwise"], e.params["transposed"]))
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(sub.eqns)
        walk(eqns)
        return found

    fwd = copies(lambda x, w: pk_jax.fp8_dot(x, w, recipe), x, w)
    assert not any(r and t for r, t in fwd) and (True, False) in fwd and (False, True) in fwd
    grad = copies(jax.grad(lambda x, w: jnp.sum(pk_jax.fp8_dot(x, w, recipe)
                                               .astype(jnp.float32)), (0, 1)), x, w)
    assert len(grad) > len(fwd)
    if recipe == "current":  # one call per operand, both copies
        assert grad[:2] == [(True, True), (True, True)]
