"""Operands stored in FP8 (`pk_jax.Fp8Weight`, `pk_jax.quantize_weight`;
`pk_jax.Fp8Activation`, `pk_jax.quantize_activation`) through fp8_dot and the
tensor-parallel matmuls on fake CPU devices, Auto and Explicit meshes: the
same bits as quantizing the operand inside the call (forward and the other
operand's gradient), a zero cotangent for the stored operand, a checkpoint's
own arrays, and the errors for operands and recipes that do not fit
together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err

SCALINGS = {"tensor": "current", "block": "block"}  # stored scaling -> recipe
FWD_TOL, GRAD_TOL = 0.06, 0.10  # test_fp8_cpu.py's bounds against float32
N = 2


def _data(rng, m, k, f):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, f)) / np.sqrt(k), jnp.bfloat16)
    return x, w


def _put(mesh, tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_quantize_weight_layout(rng, scaling):
    """data [N, K] e4m3 and factors tiling it as stored: data * factors
    reconstructs w^T within e4m3's rounding (2^-4 relative per element)."""
    _, w = _data(rng, 16, 256, 384)
    w8 = pk_jax.quantize_weight(w, scaling)
    assert w8.shape == (256, 384) and w8.dtype == jnp.float8_e4m3fn
    assert w8.data.shape == (384, 256)
    assert w8.factors.shape == ((3, 2) if scaling == "block" else ())
    f = np.asarray(w8.factors, np.float32)
    if scaling == "block":
        f = np.repeat(np.repeat(f, 128, axis=0), 128, axis=1)
    back = _f32(w8.data) * f
    assert np.all(np.abs(back - _f32(w).T) <= 2.0 ** -4 * np.abs(_f32(w).T) + 1e-30 +
                  2.0 ** -9 * np.max(np.abs(back)))
    assert rel_err(back, _f32(w).T) < 0.03


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_fp8_dot_stored_weight_is_quantizing_inside(rng, scaling):
    """fp8_dot(x, quantize_weight(w)) gives the bits of fp8_dot(x, w,
    recipe), forward and dx (leading dims of x kept); the stored weight's
    cotangent is zero."""
    recipe = SCALINGS[scaling]
    x, w = _data(rng, 256, 256, 384)
    x = x.reshape(2, 128, 256)
    t = jnp.asarray(rng.standard_normal((2, 128, 384)), jnp.float32)
    w8 = pk_jax.quantize_weight(w, scaling)
    y8 = jax.jit(pk_jax.fp8_dot)(x, w8)
    y = jax.jit(pk_jax.fp8_dot, static_argnums=2)(x, w, recipe)
    assert y8.shape == (2, 128, 384) and y8.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_f32(y8), _f32(y))
    assert rel_err(y8, _f32(x) @ _f32(w)) < FWD_TOL
    loss = lambda x, w, r=None: jnp.sum(pk_jax.fp8_dot(x, w, r).astype(jnp.float32) * t)
    dx8, dw8 = jax.jit(jax.grad(loss, (0, 1)))(x, w8)
    dx, _ = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, recipe)
    np.testing.assert_array_equal(_f32(dx8), _f32(dx))
    assert isinstance(dw8, pk_jax.Fp8Weight)
    assert not np.any(_f32(dw8.data)) and not np.any(np.asarray(dw8.factors))


def test_checkpoint_arrays_as_stored(rng):
    """A checkpoint's own e4m3 weight [N, K] with its 128x128 factors
    [N/128, K/128] (DeepSeek-V3's layout) against the float32 product of
    the dequantized weight."""
    k, n = 256, 384
    data = jnp.asarray(rng.uniform(-400, 400, (n, k)), jnp.float8_e4m3fn)
    factors = jnp.asarray(rng.uniform(1e-4, 1e-3, (n // 128, k // 128)), jnp.float32)
    w = _f32(data) * np.repeat(np.repeat(_f32(factors), 128, 0), 128, 1)  # [N, K]
    x = jnp.asarray(rng.standard_normal((128, k)), jnp.bfloat16)
    y = pk_jax.fp8_dot(x, pk_jax.Fp8Weight(data, factors, "block"))
    assert rel_err(y, _f32(x) @ w.T) < FWD_TOL


_OPS = {  # op, x spec, w spec, out spec, x shape, w shape on one "tp" axis
    "all_gather_matmul": (pk_jax.all_gather_matmul, P("tp"), P(None, "tp"), P(None, "tp"),
                          (N * 128, 256), (256, N * 128)),
    "matmul_reduce_scatter": (pk_jax.matmul_reduce_scatter, P(None, "tp"), P("tp", None),
                              P("tp"), (N * 128, N * 128), (N * 128, 256)),
    "matmul_all_reduce": (pk_jax.matmul_all_reduce, P(None, "tp"), P("tp", None), P(),
                          (128, N * 128), (N * 128, 256)),
}


def _tp_case(rng, op):
    """(fn, mesh, specs (x, w, out), x, w, t) of one TP op on N ranks of "tp"."""
    fn, xs, ws, outs, xshape, wshape = _OPS[op]
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((xshape[0], wshape[1])), jnp.float32)  # y's shape
    return fn, cpu_mesh((N,), ("tp",)), (xs, ws, outs), x, w, t


def _value_and_grad_of(body, mesh, specs, t, argnum: int):
    """jit(value_and_grad) of sum(body(x, w) * t) in shard_map, in the operand
    `argnum` (0: x, 1: w); returns f(x, w) -> ((loss, y), gradient)."""
    xs, ws, outs = specs
    f = jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=outs)

    def value(x, w):
        y = f(x, w)
        return jnp.sum(y.astype(jnp.float32) * t), y
    return jax.jit(jax.value_and_grad(value, argnum, has_aux=True))


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("op", list(_OPS))
def test_tp_ops_take_stored_weights(rng, op, scaling, sharding_mode):
    """Each rank's shard quantized inside shard_map and passed stored: the
    bits of fp8=recipe (which quantizes that shard the same way), forward
    and dx; the weight's cotangent zero."""
    fn, mesh, specs, x, w, t = _tp_case(rng, op)
    recipe = SCALINGS[scaling]
    stored = lambda x, w: fn(x, pk_jax.quantize_weight(w, scaling), "tp")
    inside = lambda x, w: fn(x, w, "tp", fp8=recipe)
    args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    (_, y8), dx8 = _value_and_grad_of(stored, mesh, specs, t, 0)(*args)
    (_, y), dx = _value_and_grad_of(inside, mesh, specs, t, 0)(*args)
    np.testing.assert_array_equal(_f32(y8), _f32(y))
    np.testing.assert_array_equal(_f32(dx8), _f32(dx))
    assert rel_err(y8, _f32(x) @ _f32(w)) < FWD_TOL


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_tp_mlp_with_sharded_stored_weights(rng, scaling, sharding_mode):
    """Weights quantized once, globally, then sharded by partition_spec (the
    checkpoint path): the TP MLP's output and dx against float32, and the
    weights' cotangents zero."""
    mesh = cpu_mesh((N,), ("tp",))
    m, d, f = N * 128, 256, N * 128
    x, w1 = _data(rng, m, d, f)
    _, w2 = _data(rng, f, f, d)
    t = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w8 = (pk_jax.quantize_weight(w1, scaling), pk_jax.quantize_weight(w2, scaling))
    specs = (w8[0].partition_spec(P(None, "tp")), w8[1].partition_spec(P("tp", None)))

    @jax.shard_map(mesh=mesh, in_specs=(P("tp"), specs), out_specs=P("tp"))
    def mlp(x, ws):
        h = pk_jax.all_gather_matmul(x, ws[0], "tp")
        return pk_jax.matmul_reduce_scatter(h, ws[1], "tp")

    args = (_put(mesh, x, P("tp")), _put(mesh, w8, specs))
    loss = lambda x, ws: jnp.sum(mlp(x, ws).astype(jnp.float32) * t)
    y = jax.jit(mlp)(*args)
    dx, dws = jax.jit(jax.grad(loss, (0, 1)))(*args)
    ref = lambda x: (x @ _f32(w1)) @ _f32(w2)
    assert y.dtype == jnp.bfloat16 and rel_err(y, ref(_f32(x))) < 2 * FWD_TOL
    rx = jax.grad(lambda x: jnp.sum(ref(x) * t))(_f32(x))
    assert rel_err(dx, rx) < 2 * GRAD_TOL
    for leaf in jax.tree.leaves(dws):
        assert not np.any(_f32(leaf))


def test_partition_spec():
    w8 = pk_jax.quantize_weight(jnp.ones((256, 128), jnp.bfloat16), "block")
    spec = w8.partition_spec(P(None, "tp"))
    assert (spec.data, spec.factors, spec.scaling) == (P("tp", None), P("tp", None), "block")
    spec = pk_jax.quantize_weight(jnp.ones((256, 128), jnp.bfloat16)).partition_spec(P("tp"))
    assert (spec.data, spec.factors) == (P(None, "tp"), P())


def test_stored_weight_bad_input(rng):
    x, w = _data(rng, 128, 256, 256)
    w8 = pk_jax.quantize_weight(w)
    b8 = pk_jax.quantize_weight(w, "block")
    cases = [
        (lambda: pk_jax.fp8_dot(x, w8, "block"), ValueError, "scaling='tensor' takes recipe"),
        (lambda: pk_jax.fp8_dot(x, b8, "current"), ValueError, "scaling='block' takes recipe"),
        (lambda: pk_jax.fp8_dot(x, w8, "delayed", scales=(1.0, 1.0, 1.0)), ValueError,
         "takes recipe='current'"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w.T, w8.factors)), TypeError,
         "data must be float8_e4m3fn"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data.astype(jnp.float8_e5m2),
                                                     w8.factors)), TypeError, "float8_e4m3fn"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data, jnp.ones(2))), ValueError,
         "takes one factor"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data, jnp.ones((2, 1)), "block")),
         ValueError, r"\(2, 2\), got \(2, 1\)"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data, jnp.ones((), jnp.bfloat16))),
         TypeError, "factors must be float32"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data, w8.factors, "rows")), ValueError,
         "expected one of"),
        (lambda: pk_jax.fp8_dot(x, pk_jax.Fp8Weight(w8.data[0], w8.factors)), ValueError,
         r"data must be \[N, K\]"),
        (lambda: pk_jax.fp8_dot(x[:, :128], w8), ValueError, "expected x"),
        (lambda: pk_jax.quantize_weight(w, "rows"), ValueError, "'tensor' or 'block'"),
    ]
    for call, err, match in cases:
        with pytest.raises(err, match=match):
            call()
    mesh = cpu_mesh((N,), ("tp",))
    with pytest.raises(ValueError, match="scaling='block' takes fp8='block'"):
        jax.jit(jax.shard_map(
            lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="current"), mesh=mesh,
            in_specs=(P("tp"), b8.partition_spec(P(None, "tp"))), out_specs=P(None, "tp")))(
                x, b8)


# ---- stored activations ------------------------------------------------------------
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_quantize_activation_layout(rng, scaling):
    """data [..., K] e4m3 with one factor or a factor per 1x128 tile of a row
    ([..., K/128]); dequantize() reconstructs x within e4m3's rounding."""
    x = jnp.asarray(rng.standard_normal((2, 64, 384)) * 3, jnp.bfloat16)
    x8 = pk_jax.quantize_activation(x, scaling)
    assert x8.shape == (2, 64, 384) and x8.dtype == jnp.float8_e4m3fn
    assert x8.factors.shape == ((2, 64, 3) if scaling == "block" else ())
    back = np.asarray(x8.dequantize())
    assert np.all(np.abs(back - _f32(x)) <= 2.0 ** -4 * np.abs(_f32(x)) +
                  2.0 ** -9 * np.max(np.abs(back)))
    if scaling == "block":  # each tile's largest element lands on e4m3's largest finite
        tiles = np.abs(_f32(x8.data)).reshape(2, 64, 3, 128).max(-1)
        np.testing.assert_array_equal(tiles, 448.0)


def _loss(t):
    return lambda x, w, r=None: jnp.sum(pk_jax.fp8_dot(x, w, r).astype(jnp.float32) * t)


@pytest.mark.parametrize("stored_w", [False, True])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_fp8_dot_stored_activation_is_quantizing_inside(rng, scaling, stored_w):
    """fp8_dot(quantize_activation(x), w) gives the bits of fp8_dot(x, w,
    recipe) (bfloat16 out); w's gradient: the same bits with one tensor
    factor (x^T is the stored data transposed), within the recipe's bound of
    float32 with block factors (x^T requantized per 128x1); x's cotangent
    zero."""
    recipe = SCALINGS[scaling]
    x, w = _data(rng, 256, 256, 384)
    t = jnp.asarray(rng.standard_normal((256, 384)), jnp.float32)
    x8 = pk_jax.quantize_activation(x, scaling)
    w_in = pk_jax.quantize_weight(w, scaling) if stored_w else w
    y8 = jax.jit(pk_jax.fp8_dot)(x8, w_in)
    y = jax.jit(pk_jax.fp8_dot, static_argnums=2)(x, w_in, recipe)
    assert y8.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_f32(y8), _f32(y))
    assert rel_err(y8, _f32(x) @ _f32(w)) < FWD_TOL
    dx8, dw8 = jax.jit(jax.grad(_loss(t), (0, 1)))(x8, w_in)
    for leaf in jax.tree.leaves(dx8) + ([] if not stored_w else jax.tree.leaves(dw8)):
        assert not np.any(_f32(leaf))
    if stored_w:
        return
    _, dw = jax.jit(jax.grad(_loss(t), (0, 1)), static_argnums=2)(x, w, recipe)
    if scaling == "tensor":
        np.testing.assert_array_equal(_f32(dw8), _f32(dw))
    assert dw8.dtype == w.dtype and rel_err(dw8, _f32(x).T @ _f32(t)) < GRAD_TOL


def test_fp8_dot_stored_activation_out_dtype(rng):
    x, w = _data(rng, 128, 256, 256)
    x8 = pk_jax.quantize_activation(x)
    y = pk_jax.fp8_dot(x8, w, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32 and rel_err(y, _f32(x) @ _f32(w)) < FWD_TOL


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("op", list(_OPS))
def test_tp_ops_take_stored_activations(rng, op, scaling, sharding_mode):
    """Each rank's x quantized inside shard_map and passed stored (a tensor
    factor gathered by all_gather_matmul from the axis-wide amax): the bits
    of fp8=recipe on the bf16 x, forward; w's gradient the same bits with a
    tensor factor, within the bound of float32 with block factors."""
    fn, mesh, specs, x, w, t = _tp_case(rng, op)
    recipe = SCALINGS[scaling]
    axis = "tp" if op == "all_gather_matmul" and scaling == "tensor" else None
    stored = lambda x, w: fn(pk_jax.quantize_activation(x, scaling, axis_name=axis), w, "tp")
    inside = lambda x, w: fn(x, w, "tp", fp8=recipe)
    args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    (_, y8), dw8 = _value_and_grad_of(stored, mesh, specs, t, 1)(*args)
    (_, y), dw = _value_and_grad_of(inside, mesh, specs, t, 1)(*args)
    np.testing.assert_array_equal(_f32(y8), _f32(y))
    assert rel_err(y8, _f32(x) @ _f32(w)) < FWD_TOL
    if scaling == "tensor":
        np.testing.assert_array_equal(_f32(dw8), _f32(dw))
    assert rel_err(dw8, _f32(x).T @ _f32(t)) < GRAD_TOL


def test_tp_mlp_on_stored_operands(rng, sharding_mode):
    """Both operands stored (an FP8 inference step): the TP MLP against
    float32; nothing is differentiated, no gradient program is needed."""
    mesh = cpu_mesh((N,), ("tp",))
    m, d, f = N * 128, 256, N * 128
    x, w1 = _data(rng, m, d, f)
    _, w2 = _data(rng, f, f, d)
    w8 = (pk_jax.quantize_weight(w1), pk_jax.quantize_weight(w2))
    specs = (w8[0].partition_spec(P(None, "tp")), w8[1].partition_spec(P("tp", None)))

    @jax.shard_map(mesh=mesh, in_specs=(P("tp"), specs), out_specs=P("tp"))
    def mlp(x, ws):
        h = pk_jax.all_gather_matmul(pk_jax.quantize_activation(x, axis_name="tp"), ws[0],
                                     "tp")
        return pk_jax.matmul_reduce_scatter(pk_jax.quantize_activation(h), ws[1], "tp")

    y = jax.jit(mlp)(_put(mesh, x, P("tp")), _put(mesh, w8, specs))
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, (_f32(x) @ _f32(w1)) @ _f32(w2)) < 2 * FWD_TOL


def test_activation_partition_spec():
    x8 = pk_jax.quantize_activation(jnp.ones((4, 128, 256), jnp.bfloat16), "block")
    spec = x8.partition_spec(P("tp"))
    assert (spec.data, spec.factors) == (P("tp", None, None), P("tp", None, None))
    spec = pk_jax.quantize_activation(jnp.ones((128, 256), jnp.bfloat16)).partition_spec(P("tp"))
    assert (spec.data, spec.factors) == (P("tp", None), P())


def test_stored_activation_bad_input(rng):
    x, w = _data(rng, 128, 256, 256)
    x8, xb = pk_jax.quantize_activation(x), pk_jax.quantize_activation(x, "block")
    mesh = cpu_mesh((N,), ("tp",))

    def gathered(x, w):  # a per-rank tensor factor, gathered
        return pk_jax.all_gather_matmul(pk_jax.quantize_activation(x), w, "tp")

    sm = jax.shard_map(gathered, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(None))
    unchecked = jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(
        pk_jax.quantize_activation(x, axis_name="tp"), w, "tp"), mesh=mesh,
        in_specs=(P("tp"), P()), out_specs=P(None), check_vma=False)
    cases = [
        (lambda: pk_jax.fp8_dot(x8, w, "block"), ValueError, "scaling='tensor' takes recipe"),
        (lambda: pk_jax.fp8_dot(xb, w, "current"), ValueError, "scaling='block' takes recipe"),
        (lambda: pk_jax.fp8_dot(x8, w, "delayed", scales=(1.0, 1.0, 1.0)), ValueError,
         "takes recipe='current'"),
        (lambda: pk_jax.fp8_dot(x8, pk_jax.quantize_weight(w, "block")), ValueError,
         "must share a scaling"),
        (lambda: pk_jax.fp8_dot(pk_jax.Fp8Activation(x, x8.factors), w), TypeError,
         "data must be float8_e4m3fn"),
        (lambda: pk_jax.fp8_dot(pk_jax.Fp8Activation(x8.data, jnp.ones((128, 1)), "block"), w),
         ValueError, r"\(128, 2\), got \(128, 1\)"),
        (lambda: pk_jax.fp8_dot(pk_jax.Fp8Activation(x8.data, jnp.ones(2)), w), ValueError,
         "takes one factor"),
        (lambda: pk_jax.fp8_dot(x8, w, out_dtype=jnp.int8), TypeError, "out_dtype"),
        (lambda: pk_jax.quantize_activation(x, "rows"), ValueError, "'tensor' or 'block'"),
        (lambda: pk_jax.quantize_activation(x, "block", axis_name="tp"), ValueError,
         "axis_name is for scaling='tensor'"),
        (lambda: jax.jit(sm)(x, w), ValueError, "tensor factor varies over axis"),
        (lambda: jax.jit(unchecked)(x, w), ValueError, "needs shard_map's varying-axes"),
    ]
    for call, err, match in cases:
        with pytest.raises(err, match=match):
            call()
