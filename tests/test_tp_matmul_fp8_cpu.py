"""The FP8 paths of the tensor-parallel matmuls (fp8= recipes) on 8 fake CPU
devices, Auto and Explicit meshes: values and gradients against float32
references, with test_fp8_cpu.py's tolerances (block factors in the host
sequences: also against the products of the dequantized operands,
helpers/fp8_refs.py), and the errors for shapes the FP8 path does not
take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from helpers.fp8_refs import block_products

FWD_TOL, GRAD_TOL = 0.06, 0.10
N = 2


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def _data(rng, m, k, f):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, f)) / np.sqrt(k), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("recipe", ["current", "block",
                                    pk_jax.Fp8Recipe("block", wgrad_dy_blocks=True)])
def test_fp8_mlp_values_and_gradients(rng, recipe, sharding_mode):
    """Column- then row-parallel pair (the TP MLP): the output and the
    gradients of x, w1, w2 against float32 (two FP8 GEMMs deep: twice the
    one-GEMM bounds); block scaling also with dy^T per 128x128 in the weight
    gradients (gathered along the tokens in matmul_reduce_scatter's)."""
    mesh = cpu_mesh((N,), ("tp",))
    m, d, f = N * 128, 128, N * 128
    x, w1 = _data(rng, m, d, f)
    _, w2 = _data(rng, f, f, d)
    t = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)

    @jax.shard_map(mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
                   out_specs=P("tp"))
    def mlp(x, w1, w2):
        h = pk_jax.all_gather_matmul(x, w1, "tp", fp8=recipe)
        return pk_jax.matmul_reduce_scatter(h, w2, "tp", fp8=recipe)

    args = (_put(mesh, x, P("tp")), _put(mesh, w1, P(None, "tp")), _put(mesh, w2, P("tp", None)))
    loss = lambda *a: jnp.sum(mlp(*a).astype(jnp.float32) * t)
    y = jax.jit(mlp)(*args)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
    f32 = lambda a: a.astype(jnp.float32)
    ref = lambda x, w1, w2: (f32(x) @ f32(w1)) @ f32(w2)
    rgrads = jax.grad(lambda *a: jnp.sum(ref(*a) * t), (0, 1, 2))(x, w1, w2)
    assert y.dtype == jnp.bfloat16 and rel_err(y, ref(x, w1, w2)) < 2 * FWD_TOL
    for g, r in zip(grads, rgrads):
        assert g.dtype == jnp.bfloat16 and rel_err(g, r) < 2 * GRAD_TOL


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_fp8_all_gather_matmul_forward(rng, recipe, sharding_mode):
    mesh = cpu_mesh((N,), ("tp",))
    x, w = _data(rng, N * 128, 256, N * 128)
    f = jax.jit(jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8=recipe),
                              mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                              out_specs=P(None, "tp")))
    y = f(_put(mesh, x, P("tp")), _put(mesh, w, P(None, "tp")))
    assert y.shape == (N * 128, N * 128) and y.dtype == jnp.bfloat16
    assert rel_err(y, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_fp8_matmul_all_reduce(rng, recipe, sharding_mode):
    mesh = cpu_mesh((N,), ("tp",))
    x, w = _data(rng, 128, N * 128, 256)
    t = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)

    @jax.shard_map(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
    def f(x, w):
        return pk_jax.matmul_all_reduce(x, w, "tp", fp8=recipe)

    args = (_put(mesh, x, P(None, "tp")), _put(mesh, w, P("tp", None)))
    y = jax.jit(f)(*args)
    assert rel_err(y, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t),
                              (0, 1)))(*args)
    rx, rw = jax.grad(lambda x, w: jnp.sum((x.astype(jnp.float32) @ w.astype(jnp.float32)) * t),
                      (0, 1))(x, w)
    assert rel_err(dx, rx) < GRAD_TOL and rel_err(dw, rw) < GRAD_TOL


def test_fp8_tp_bad_input(rng):
    mesh = cpu_mesh((N,), ("tp",))
    x, w = _data(rng, N * 128, 256, N * 128)
    run = lambda fn, xs, ws, ins, outs: jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=ins, out_specs=outs))(_put(mesh, xs, ins[0]), _put(mesh, ws, ins[1]))
    ag = (P("tp"), P(None, "tp"))
    with pytest.raises(ValueError, match="rows per device"):
        run(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="block"), x[:N * 64], w, ag,
            P(None, "tp"))
    with pytest.raises(ValueError, match="N \\(w.shape\\[1\\]\\)"):
        run(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="block"), x,
            w[:, :N * 96], ag, P(None, "tp"))
    with pytest.raises(ValueError, match="mechanism"):
        run(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="current", mechanism="xla"),
            x, w, ag, P(None, "tp"))
    with pytest.raises(ValueError, match="return_gathered"):
        run(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="current",
                                                  return_gathered=True)[0], x, w, ag,
            P(None, "tp"))
    with pytest.raises(ValueError, match="delayed"):
        run(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8="delayed"), x, w, ag,
            P(None, "tp"))


# ---- delayed scaling: the caller's scales, axis-wide amaxes --------------------------
_OPS = {  # op, x spec, w spec, out spec, x shape, w shape on a (sp=2, tp=2) mesh
    "all_gather_matmul": (pk_jax.all_gather_matmul, P(("sp", "tp")), P(None, "tp"),
                          P("sp", "tp"), (4 * 32, 64), (64, 2 * 32)),
    "matmul_reduce_scatter": (pk_jax.matmul_reduce_scatter, P("sp", "tp"), P("tp", None),
                              P(("sp", "tp")), (2 * 64, 2 * 32), (2 * 32, 64)),
    "matmul_all_reduce": (pk_jax.matmul_all_reduce, P("sp", "tp"), P("tp", None),
                          P("sp"), (2 * 32, 2 * 32), (2 * 32, 64)),
}


@pytest.mark.parametrize("op", list(_OPS))
def test_fp8_delayed_scales_and_amaxes(rng, op, sharding_mode):
    """fp8='delayed' with given scales on a 2-D mesh (the tokens also sharded
    over "sp", the op over "tp"): values and gradients against float32, the
    amaxes of x and w and, as the dy scale's cotangent, of dy: each the
    maximum over every device (the scales are replicated), returned
    replicated (out_specs P())."""
    fn, xs, ws, outs, xshape, wshape = _OPS[op]
    mesh = cpu_mesh((2, 2), ("sp", "tp"))
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)
    # dy arrives in bf16 (values that bf16 holds: XLA may skip the rounding)
    t = jnp.asarray(rng.standard_normal((xshape[0], wshape[1])), jnp.bfloat16).astype(jnp.float32)
    amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))
    # scales a history would give: from amaxes a little off the true ones
    scales = (jnp.float32(448 / (1.2 * amax(x))), jnp.float32(448 / (0.9 * amax(w))),
              jnp.float32(57344 / amax(t)))

    @jax.shard_map(mesh=mesh, in_specs=(xs, ws, P()), out_specs=(outs, P()))
    def f(x, w, s):
        return fn(x, w, "tp", fp8="delayed", fp8_scales=s)

    args = (_put(mesh, x, xs), _put(mesh, w, ws), scales)
    y, (ax, aw) = jax.jit(f)(*args)
    f32 = lambda a: np.asarray(a, np.float32)
    assert y.dtype == jnp.bfloat16 and rel_err(y, f32(x) @ f32(w)) < FWD_TOL
    assert ax.shape == aw.shape == (1,)
    assert float(ax[0]) == amax(x) and float(aw[0]) == amax(w)
    loss = lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * t)
    dx, dw, ds = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
    rx, rw = jax.grad(lambda x, w: jnp.sum((x.astype(jnp.float32) @ w.astype(jnp.float32)) * t),
                      (0, 1))(x, w)
    assert rel_err(dx, rx) < GRAD_TOL and rel_err(dw, rw) < GRAD_TOL
    assert float(ds[0]) == float(ds[1]) == 0.0
    assert float(ds[2]) == amax(t)


def test_fp8_delayed_bad_scales(rng):
    mesh = cpu_mesh((N,), ("tp",))
    x, w = _data(rng, N * 32, 64, N * 32)
    args = (_put(mesh, x, P("tp")), _put(mesh, w, P(None, "tp")))

    def run(check_vma=True, **kw):
        return jax.jit(jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", **kw),
                                     mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                     out_specs=P(None, "tp"), check_vma=check_vma))(*args)

    with pytest.raises(ValueError, match="fp8_scales=.*required with recipe 'delayed'"):
        run(fp8="delayed")
    with pytest.raises(ValueError, match="fp8_scales=.*only there"):
        run(fp8="current", fp8_scales=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="fp8_scales needs fp8='delayed'"):
        run(fp8_scales=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="fp8_scales must be"):
        run(fp8="delayed", fp8_scales=(1.0, 1.0))
    with pytest.raises(ValueError, match="fp8_scales's w_scale must be one float"):
        run(fp8="delayed", fp8_scales=(1.0, jnp.ones(2), 1.0))
    with pytest.raises(ValueError, match="pk_jax.all_gather_matmul: fp8_scales's dy_scale must "
                       "be a finite number > 0"):
        run(fp8="delayed", fp8_scales=(1.0, 1.0, float("inf")))
    with pytest.raises(ValueError, match="check_vma"):
        run(check_vma=False, fp8="delayed", fp8_scales=(1.0, 1.0, 1.0))


# ---- the FP8 host sequences (bfloat16 results) -----------------------------------------
_SEQUENCES = {"all_gather_matmul": ("pk_all_gather_matmul_fp8", "pk_matmul_reduce_scatter_fp8"),
              "matmul_reduce_scatter": ("pk_matmul_reduce_scatter_fp8",
                                        "pk_all_gather_matmul_fp8"),
              "matmul_all_reduce": ("pk_matmul_all_reduce_fp8", None)}


@pytest.mark.parametrize("op", list(_OPS))
def test_fp8_sequences_are_the_composed_numerics(rng, op, monkeypatch, sharding_mode):
    """Per-tensor FP8 with a bfloat16 result runs the host sequences'
    primitives (forward, and the other op's as dx); their references give
    the bits of the collectives and GEMMs composed one after the other (the
    path a float32 result takes), values and gradients; a float32 result
    keeps the composed path (block factors: test_fp8_block_sequences)."""
    from pk_jax.ops.tp_matmul import fp8 as tp_matmul_fp8
    fn, xs, ws, outs, xshape, wshape = _OPS[op]
    mesh = cpu_mesh((2, 2), ("sp", "tp"))
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((xshape[0], wshape[1])), jnp.float32)

    def run(recipe="current", **kw):
        f = jax.shard_map(lambda x, w: fn(x, w, "tp", fp8=recipe, **kw), mesh=mesh,
                          in_specs=(xs, ws), out_specs=outs)
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t)
        args = (_put(mesh, x, xs), _put(mesh, w, ws))
        text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(*args))
        return (jax.jit(f)(*args), *jax.jit(jax.grad(loss, (0, 1)))(*args)), text

    fwd, bwd = _SEQUENCES[op]
    fused, text = run()
    assert fwd in text and (bwd is None or bwd in text)
    # a float32 y: the forward composed (dx, of x's bfloat16, still a sequence)
    assert fwd not in run(preferred_element_type=jnp.float32)[1]
    sequences = lambda text: [s for s in _SEQUENCES[op] if s and s in text]
    monkeypatch.setattr(tp_matmul_fp8, "_fused", lambda *a: False)
    composed, text = run()
    assert not sequences(text)
    for got, want in zip(fused, composed):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    f32 = lambda a: np.asarray(a, np.float32)
    assert rel_err(fused[0], f32(x) @ f32(w)) < FWD_TOL


# ---- block factors in the host sequences ----------------------------------------------
def _block_case(op: str, n: int, rows: int):
    """(fn, specs (x, w, out), x shape, w shape) of one TP op on n ranks of
    "tp" with block-sized shards (multiples of 128): `rows` rows of x per
    rank (all_gather_matmul, matmul_reduce_scatter's output) or in all
    (matmul_all_reduce)."""
    return {"all_gather_matmul": (pk_jax.all_gather_matmul, (P("tp"), P(None, "tp"),
                                                             P(None, "tp")),
                                  (n * rows, 256), (256, n * 128)),
            "matmul_reduce_scatter": (pk_jax.matmul_reduce_scatter,
                                      (P(None, "tp"), P("tp", None), P("tp")),
                                      (n * rows, n * 128), (n * 128, 256)),
            "matmul_all_reduce": (pk_jax.matmul_all_reduce, (P(None, "tp"), P("tp", None), P()),
                                  (rows, n * 128), (n * 128, 256))}[op]


# (op, n, rows): matmul_all_reduce at 512 rows chunked (row groups of 512 / n),
# at 128 one_shot (one group)
_BLOCK_CASES = [(op, n, rows) for n in (2, 4) for op, rows in
                (("all_gather_matmul", 128), ("matmul_reduce_scatter", 128),
                 ("matmul_reduce_scatter", 256), ("matmul_all_reduce", 512),
                 ("matmul_all_reduce", 128))]


@pytest.mark.parametrize("op,n,rows", _BLOCK_CASES)
def test_fp8_block_sequences(rng, op, n, rows, monkeypatch):
    """fp8="block" with a bfloat16 result runs the host sequences'
    primitives (forward, and the other op's as dx) with the operands' block
    factors in the sequences' row chunks: values and gradients against the
    float32 products of the dequantized operands (each quantized as a whole:
    the shards' blocks are the whole's), within bfloat16 rounding; the bits
    of the composed collectives and GEMMs; and against the unquantized
    float32 products within the FP8 bounds. Fresh random inputs."""
    from pk_jax.ops.tp_matmul import fp8 as tp_matmul_fp8
    fn, (xs, ws, outs), xshape, wshape = _block_case(op, n, rows)
    mesh = cpu_mesh((n,), ("tp",))
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)
    # dy arrives in bf16 (loss's cotangent of the bf16 y)
    t = jnp.asarray(rng.standard_normal((xshape[0], wshape[1])), jnp.bfloat16)

    def run():
        f = jax.shard_map(lambda x, w: fn(x, w, "tp", fp8="block"), mesh=mesh,
                          in_specs=(xs, ws), out_specs=outs)
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t.astype(jnp.float32))
        args = (_put(mesh, x, xs), _put(mesh, w, ws))
        text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(*args))
        return (jax.jit(f)(*args), *jax.jit(jax.grad(loss, (0, 1)))(*args)), text

    fused, text = run()
    fwd, bwd = _SEQUENCES[op]
    assert fwd in text and (bwd is None or bwd in text)
    f32 = lambda a: np.asarray(a, np.float32)
    for name, got, ref in zip(("y", "dx", "dw"), fused, block_products(x, w, t)):
        assert got.dtype == jnp.bfloat16 and got.shape == ref.shape, name
        assert rel_err(got, ref) < 1e-2, name
    assert rel_err(fused[0], f32(x) @ f32(w)) < FWD_TOL
    assert rel_err(fused[1], f32(t) @ f32(w).T) < GRAD_TOL
    assert rel_err(fused[2], f32(x).T @ f32(t)) < GRAD_TOL
    monkeypatch.setattr(tp_matmul_fp8, "_fused", lambda *a: False)
    composed, text = run()
    assert fwd not in text and (bwd is None or bwd not in text)
    for got, ref in zip(fused, composed):
        np.testing.assert_array_equal(f32(got), f32(ref))


@pytest.mark.parametrize("op,n,rows", [c for c in _BLOCK_CASES if c[1] == 2])
def test_fp8_block_sequences_take_stored_activations(rng, op, n, rows):
    """A stored block Fp8Activation (its factors [rows, K/128] as stored)
    enters the sequences in their row chunks: the bits of quantizing x
    inside the call."""
    fn, (xs, ws, outs), xshape, wshape = _block_case(op, n, rows)
    mesh = cpu_mesh((n,), ("tp",))
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)

    def run(stored: bool):
        body = ((lambda x, w: fn(pk_jax.quantize_activation(x, "block"), w, "tp")) if stored
                else (lambda x, w: fn(x, w, "tp", fp8="block")))
        f = jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=outs)
        args = (_put(mesh, x, xs), _put(mesh, w, ws))
        assert _SEQUENCES[op][0] in str(jax.make_jaxpr(f)(*args))
        return jax.jit(f)(*args)

    np.testing.assert_array_equal(np.asarray(run(True), np.float32),
                                  np.asarray(run(False), np.float32))
