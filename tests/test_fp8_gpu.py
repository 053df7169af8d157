"""pk_jax's FP8 kernels on GPUs (one unless said) against their references (the same
numerics in jax.numpy, run by XLA on the host's CPU, whose float32 division
is IEEE's as the kernel's is; XLA:GPU divides approximately): quantization
bit for bit, the
scaled GEMMs within fp32-summation-order tolerance, fp8_dot's values and
gradients against float32 matmuls (test_fp8_cpu.py states the tolerances),
the TP ops' FP8 host sequences (one GPU: the composed path's bits; block
factors on 2 and 4 GPUs: the dequantized operands' products,
helpers/fp8_refs.py).
Fresh random inputs each run; the allocator is poisoned before each kernel
call, so an element a kernel leaves unwritten shows as a mismatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from conftest import gpu_mesh, rel_err
from pk_jax import runtime, tuning
from helpers.gpu_util import poison_allocator
from pk_jax.ops.fp8 import primitive as prim

pytestmark = pytest.mark.gpu

FWD_TOL, GRAD_TOL = 0.06, 0.10


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 \
        else np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("granularity", ["tensor", "rows", "cols", "blocks", "rows_cols",
                                         "rows_blocks"])
# vector accesses with whole tiles, with partial tiles (rows and columns multiples of 8),
# scalar accesses (300 rows; 130 columns: the rows kernel's too)
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 128), (136, 264), (300, 200),
                                   (64, 130)])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_bitwise(rng, granularity, shape, in_dtype, dtype):
    mesh = gpu_mesh(1)
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 100), in_dtype)
    # every copy the granularity has: rows row-wise only, cols transposed only, the
    # others both (rows_cols and rows_blocks: each with its factors)
    kw = dict(granularity=granularity, dtype=jnp.dtype(dtype), rowwise=granularity != "cols",
              transposed=granularity != "rows", given_scale=False, margin=0.0)
    hlo = jax.jit(lambda x: prim.quantize(x, **{k: v for k, v in kw.items()
                                                if k != "given_scale"})).lower(x).as_text()
    assert "pk_fp8_quantize" in hlo  # the kernel, not a fallback
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        want = jax.jit(lambda x: prim.quantize_reference(x, jnp.ones((1,), jnp.float32), **kw))(
            np.asarray(x))
    poison_allocator(mesh, 4 * x.size)
    got = jax.jit(lambda x: prim.quantize(x, **{k: v for k, v in kw.items()
                                                if k != "given_scale"}))(x)
    for name, g, w in zip(("q", "qt", "factors", "factors_t", "amax"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


@pytest.mark.parametrize("granularity", ["tensor", "rows", "cols", "blocks", "rows_cols",
                                         "rows_blocks"])
def test_vanishing_blocks_quantize_to_zeros_not_nan(rng, granularity):
    """Blocks of vanishing values (a confident softmax's gradients) with
    zeros among them: the scale is capped at 2^126, so they quantize to
    finite values, bit for bit as the reference, never NaN (0 * inf)."""
    mesh = gpu_mesh(1)
    # magnitudes 1e-37..2e-37 (normal floats: no denormal flushed on either side)
    x = (np.sign(rng.standard_normal((512, 768))) * rng.uniform(1, 2, (512, 768))).astype(
        np.float32)
    # whole 1x128, 128x1 and 128x128 blocks vanish (per tensor: all of it)
    x[:, :768 if granularity == "tensor" else 256] *= 1e-37
    x[::3, :256] = 0.0
    x = jnp.asarray(x)
    kw = dict(granularity=granularity, dtype=jnp.dtype(jnp.float8_e4m3fn),
              rowwise=granularity != "cols", transposed=granularity != "rows", margin=0.0)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        want = jax.jit(lambda x: prim.quantize_reference(
            x, jnp.ones((1,), jnp.float32), given_scale=False, **kw))(np.asarray(x))
    poison_allocator(mesh, 4 * x.size)
    got = jax.jit(lambda x: prim.quantize(x, **kw))(x)
    for name, g, w in zip(("q", "qt", "factors", "factors_t", "amax"), got, want):
        assert not np.isnan(np.asarray(g, np.float32)).any(), name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


# row groups: whole tiles (vector accesses), groups of 100 rows with a partial column
# tile (scalar accesses)
@pytest.mark.parametrize("shape,groups", [((1024, 4096), 2), ((1024, 4096), 4), ((300, 200), 3)])
@pytest.mark.parametrize("granularity", ["rows", "rows_cols"])
def test_quantize_row_groups_bitwise(rng, shape, groups, granularity):
    """Factors per 1x128 rows with row_groups (alone, and beside the
    transposed copy's 128x1): q, qt and the grouped factors ([groups *
    C/128, R / groups]) bit for bit against the reference."""
    mesh = gpu_mesh(1)
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 100), jnp.bfloat16)
    kw = dict(granularity=granularity, dtype=jnp.dtype(jnp.float8_e4m3fn), rowwise=True,
              transposed=granularity != "rows", margin=0.0, row_groups=groups)
    f = jax.jit(lambda x: prim.quantize(x, **kw))
    assert "pk_fp8_quantize" in f.lower(x).as_text()  # the kernel, not a fallback
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        want = jax.jit(lambda x: prim.quantize_reference(
            x, jnp.ones((1,), jnp.float32), given_scale=False, **kw))(np.asarray(x))
    poison_allocator(mesh, 4 * x.size)
    got = f(x)
    for name, g, w in zip(("q", "qt", "factors", "factors_t", "amax"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


# delayed scaling's one pass: the amax of this call taken while quantizing with
# the given scale (whole tiles, partial tiles, scalar accesses; both formats)
@pytest.mark.parametrize("shape", [(512, 768), (8192, 5120), (1000, 520), (300, 200)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_given_scale_and_amax(rng, shape, dtype):
    mesh = gpu_mesh(1)
    x = jnp.asarray(rng.standard_normal(shape) * 5, jnp.bfloat16)
    # saturates the largest values
    s = jnp.float32(prim.FP8_MAX[jnp.dtype(dtype)] / 7)
    poison_allocator(mesh, 4 * x.size)
    q, qt, f, amax = pk_jax.fp8_quantize(x, "tensor", dtype, transposed=True, scale=s)
    assert float(amax[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        rq, rqt, rf, ramax = jax.jit(lambda x: prim.quantize_reference(
            x, np.float32(s).reshape(1), granularity="tensor", dtype=jnp.dtype(dtype),
            rowwise=True, transposed=True, given_scale=True, margin=0.0))(np.asarray(x))
    for g, w in ((q, rq), (qt, rqt), (f, rf), (amax, ramax)):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_cublaslt_is_loaded():
    """The per-tensor FP8 GEMMs can run cuBLASLt: the extension was built with
    its header and found the library XLA loaded (csrc/kernels/gemm/cublaslt.h)."""
    gpu_mesh(1)
    runtime.ensure_ready()
    version = runtime.extension().cublaslt_version()
    assert version >= 120000, (f"cuBLASLt version {version}: built without cublasLt.h, or no "
                               "libcublasLt.so.13/.12 in the process or on the library path")


# whole and partial 128x256 (e4m3) and 128x192 (promoted) tiles; a long K
# (128 promotions)
def _tensor_operands(rng, m, n, k, a_t, b_t):
    """Fresh FP8 a [m, k], b [n, k] of the named types, one factor each, and
    the float32 product they stand for; the allocator poisoned for the
    output. Skips first where there is no GPU."""
    mesh = gpu_mesh(1)
    types = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
    a = jnp.asarray(rng.standard_normal((m, k)) * 8, types[a_t])
    b = jnp.asarray(rng.standard_normal((n, k)) * 8, types[b_t])
    sa, sb = (jnp.asarray(rng.uniform(0.01, 0.1, (1,)), jnp.float32) for _ in range(2))
    want = prim.matmul_reference(a, b, sa, sb, scaling="tensor", b_row_blocks=False,
                                 out_dtype=jnp.float32)
    poison_allocator(mesh, 4 * m * n)
    return a, b, sa, sb, want


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (512, 384, 640), (128, 8, 16),
                                   (2048, 6144, 1024), (1000, 520, 4112), (256, 392, 16384)])
@pytest.mark.parametrize("a_t,b_t", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("library", ["cublaslt", "cutlass"])
def test_matmul_tensor(rng, m, n, k, a_t, b_t, out, library):
    """Per-tensor factors, each library (tuning.fp8_gemm_library: cuBLASLt
    by default, pk's CUTLASS kernels forced)."""
    a, b, sa, sb, want = _tensor_operands(rng, m, n, k, a_t, b_t)
    f = jax.jit(lambda *x: pk_jax.fp8_matmul(*x, out_dtype=out))
    with tuning.forced(fp8_gemm_library=library):  # lowered on the first call
        assert f'library = {prim.LIBRARY[library]}' in f.lower(a, b, sa, sb).as_text()
        got = f(a, b, sa, sb)
    assert got.dtype == out and np.isfinite(np.asarray(got, np.float32)).all()
    # fp32 sums in another order; e4m3 x e4m3 runs the tensor cores' fast
    # accumulation (about 14 bits kept: DeepSeek-V3 reports up to ~2% per
    # element at K = 4096), the others promote to fp32 every 4 K-steps
    fast = a_t == b_t == "e4m3"
    assert rel_err(got, want) < (1e-2 if fast else 3e-3 if out == jnp.bfloat16 else 2e-3)


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1000, 520, 4112), (256, 392, 16384)])
@pytest.mark.parametrize("a_t,b_t", [("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_matmul_fast_accum(rng, m, n, k, a_t, b_t):
    """fast_accum=True: the e5m2 products through cuBLASLt without fp32
    promotion, within the e4m3 x e4m3 product's bound of the fp32 sums."""
    a, b, sa, sb, want = _tensor_operands(rng, m, n, k, a_t, b_t)
    f = jax.jit(lambda *x: pk_jax.fp8_matmul(*x, out_dtype=jnp.bfloat16, fast_accum=True))
    assert "fast_accum = true" in f.lower(a, b, sa, sb).as_text()
    got = f(a, b, sa, sb)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (512, 384, 640), (132, 256, 128)])
@pytest.mark.parametrize("row_blocks", [False, True])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("library", ["cutlass", "cublaslt"])
def test_matmul_block(rng, m, n, k, row_blocks, out, library):
    if m % 4 or (row_blocks and n % 4):
        pytest.skip("block factors need M (and N with row blocks) multiples of 4")
    mesh = gpu_mesh(1)
    a = jnp.asarray(rng.standard_normal((m, k)) * 8, jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((n, k)) * 8, jnp.float8_e4m3fn)
    kb = prim.blocks(k)
    sa = jnp.asarray(rng.uniform(0.01, 0.1, (kb, m)), jnp.float32)
    sb = jnp.asarray(rng.uniform(0.01, 0.1, (kb, n if row_blocks else prim.blocks(n))),
                     jnp.float32)
    want = prim.matmul_reference(a, b, sa, sb, scaling="block", b_row_blocks=row_blocks,
                                 out_dtype=jnp.float32)
    poison_allocator(mesh, 4 * m * n)
    f = jax.jit(lambda *x: pk_jax.fp8_matmul(*x, scaling="block", b_row_blocks=row_blocks,
                                              out_dtype=out))
    with tuning.forced(fp8_gemm_library=library):  # lowered on the first call
        got = f(a, b, sa, sb)
    # float32 out: the per-block products summed in another order
    assert rel_err(got, want) < (3e-3 if out == jnp.bfloat16 else 5e-4)


@pytest.mark.parametrize("recipe,fast", [("current", False), ("delayed", False),
                                         ("block", False), ("current", True),
                                         ("delayed", True), ("block_wgrad_dy_blocks", False)])
@pytest.mark.parametrize("m,k,n", [(2048, 1024, 1536), (256, 128, 384), (1040, 528, 400)])
def test_fp8_dot_values_and_gradients(rng, recipe, fast, m, k, n):
    """Each recipe, with fast accumulation in the gradient GEMMs, and block
    scaling with dy^T per 128x128 for the weight gradient."""
    r = pk_jax.Fp8Recipe("block", wgrad_dy_blocks=True) if recipe == "block_wgrad_dy_blocks" \
        else pk_jax.Fp8Recipe(recipe, fast_gradient_accumulation=fast)
    recipe = r.scaling
    if recipe == "block" and (k % 128 or n % 128):
        pytest.skip("block scaling needs K and N multiples of 128")
    mesh = gpu_mesh(1)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    # delayed: the scales an amax history of inputs like these gives
    scales = (np.float32(448 / 5), np.float32(448 * np.sqrt(k) / 5), np.float32(57344 / 64))
    dot = (lambda x, w: pk_jax.fp8_dot(x, w, r, scales=scales)[0]) \
        if recipe == "delayed" else (lambda x, w: pk_jax.fp8_dot(x, w, r))
    loss = lambda x, w: jnp.sum(dot(x, w).astype(jnp.float32) * t)
    # the loss is linear in y, so its gradient needs no forward GEMM: dgrad and
    # wgrad, both FP8 kernels; the forward is one more
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    assert hlo.count("pk_fp8_matmul") == 2
    assert hlo.count(f"fast_accum = {str(fast).lower()}") == 2
    assert jax.jit(dot).lower(x, w).as_text().count("pk_fp8_matmul") == 1
    poison_allocator(mesh, 8 * m * (k + n))
    y = jax.jit(dot)(x, w)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    f32 = lambda x, w: jnp.sum((x.astype(jnp.float32) @ w.astype(jnp.float32)) * t)
    gx, gw = jax.jit(jax.grad(f32, (0, 1)))(x, w)
    assert rel_err(y, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL
    assert rel_err(dx, gx) < GRAD_TOL and rel_err(dw, gw) < GRAD_TOL


@pytest.mark.parametrize("scaling,recipe", [("tensor", "current"), ("block", "block")])
def test_fp8_dot_stored_weight(rng, scaling, recipe):
    """A stored weight (pk_jax.quantize_weight) through the kernels: the bits
    of quantizing it inside the call, forward and dx; dx is one FP8 GEMM on
    the kernel."""
    mesh = gpu_mesh(1)
    m, k, n = 2048, 1024, 1536
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    w8 = jax.jit(pk_jax.quantize_weight, static_argnums=1)(w, scaling)
    loss = lambda x, w, r=None: jnp.sum(pk_jax.fp8_dot(x, w, r).astype(jnp.float32) * t)
    grad = jax.jit(jax.grad(loss), static_argnums=2)
    assert grad.lower(x, w8).as_text().count("pk_fp8_matmul") == 1
    poison_allocator(mesh, 8 * m * (k + n))
    y8, dx8 = jax.jit(pk_jax.fp8_dot)(x, w8), grad(x, w8)
    y, dx = jax.jit(pk_jax.fp8_dot, static_argnums=2)(x, w, recipe), grad(x, w, recipe)
    np.testing.assert_array_equal(np.asarray(y8, np.float32), np.asarray(y, np.float32))
    np.testing.assert_array_equal(np.asarray(dx8, np.float32), np.asarray(dx, np.float32))
    assert rel_err(y8, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL


@pytest.mark.parametrize("recipe", ["current", "block"])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_tp_fp8_sequences_on_one_gpu(rng, op, recipe, monkeypatch):
    """fp8="current" or "block" with bf16 results runs the TP host sequences
    on FP8 operands (one rank: the sequence's GEMM; block: with x's factors
    [K/128, M] as one row group), forward and dx: the bits of the composed
    path (quantize, then pk's FP8 GEMM), poisoned outputs; block: also
    within bfloat16 rounding of the dequantized operands' products."""
    from jax.sharding import PartitionSpec as P
    from pk_jax.ops.tp_matmul import fp8 as tp_matmul_fp8
    mesh = gpu_mesh(1, "tp")
    fn = getattr(pk_jax, op)
    m, k, n = 1024, 768, 1536
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

    def run(sequence: bool):
        # traced afresh (no jit cache across the monkeypatch)
        f = jax.shard_map(lambda x, w: fn(x, w, "tp", fp8=recipe), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t)
        assert (f"pk_{op}_fp8" in jax.jit(f).lower(x, w).as_text()) == sequence
        poison_allocator(mesh, 16 * m * (k + n))
        return (jax.jit(f)(x, w), *jax.jit(jax.grad(loss, (0, 1)))(x, w))

    fused = run(True)
    monkeypatch.setattr(tp_matmul_fp8, "_fused", lambda *a: False)
    composed = run(False)
    for got, want in zip(fused, composed):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert rel_err(fused[0], np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < FWD_TOL
    if recipe == "block":  # dy: the bf16 y's cotangent, t in bf16
        for name, got, ref in zip(("y", "dx", "dw"), fused,
                                  _block_refs(x, w, t.astype(jnp.bfloat16))):
            assert rel_err(got, ref) < 1e-2, name


def _block_refs(x, w, dy):
    """helpers/fp8_refs.py's (y, dx, dw) of fp8="block", on the host's CPU."""
    from helpers.fp8_refs import block_products
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return block_products(*(np.asarray(a) for a in (x, w, dy)))


# (op, rows): rows of x per rank (all_gather_matmul, matmul_reduce_scatter's
# output) or in all (matmul_all_reduce: 2048 chunked, its row groups of 2048 / n;
# 128 one_shot, one group)
_BLOCK_TP = [("all_gather_matmul", 512), ("matmul_reduce_scatter", 512),
             ("matmul_all_reduce", 2048), ("matmul_all_reduce", 128)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op,rows", _BLOCK_TP)
def test_tp_fp8_block_sequences_across_gpus(rng, op, rows, n):
    """fp8="block" on n GPUs runs the host sequences with block factors
    (all_gather_matmul's rows travel with their factors; the row chunks of
    matmul_reduce_scatter, matmul_all_reduce and all_gather_matmul's dx
    read theirs): forward and gradients against the float32 products of
    the dequantized operands (helpers/fp8_refs.py) within bfloat16 rounding,
    poisoned outputs, fresh random inputs, two calls (the channels' next
    epoch)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = gpu_mesh(n, "tp")
    k, cols = n * 256, n * 384  # K and N of the whole product, 256 / 384 a rank
    xs, ws, outs, xshape = {
        "all_gather_matmul": (P("tp"), P(None, "tp"), P(None, "tp"), (n * rows, 512)),
        "matmul_reduce_scatter": (P(None, "tp"), P("tp", None), P("tp"), (n * rows, k)),
        "matmul_all_reduce": (P(None, "tp"), P("tp", None), P(), (rows, k))}[op]
    wshape = (xshape[1], cols if op == "all_gather_matmul" else 768)
    fn = getattr(pk_jax, op)
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(wshape[0]), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((xshape[0], wshape[1])), jnp.bfloat16)
    f = jax.shard_map(lambda x, w: fn(x, w, "tp", fp8="block"), mesh=mesh, in_specs=(xs, ws),
                      out_specs=outs)
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t.astype(jnp.float32))
    args = (jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    grad = jax.jit(jax.grad(loss, (0, 1)))
    assert f"pk_{op}_fp8" in jax.jit(f).lower(*args).as_text()
    if op != "matmul_all_reduce":  # dx: the other op's sequence
        other = "matmul_reduce_scatter" if op == "all_gather_matmul" else "all_gather_matmul"
        assert f"pk_{other}_fp8" in grad.lower(*args).as_text()
    refs = _block_refs(x, w, t)
    for _ in range(2):
        poison_allocator(mesh, 8 * x.size + 8 * t.size)
        got = (jax.jit(f)(*args), *grad(*args))
        for name, g, ref in zip(("y", "dx", "dw"), got, refs):
            assert g.dtype == jnp.bfloat16 and g.shape == ref.shape, name
            assert rel_err(g, ref) < 1e-2, name
    pk_jax.check_errors()


@pytest.mark.parametrize("scaling,recipe", [("tensor", "current"), ("block", "block")])
@pytest.mark.parametrize("op", ["fp8_dot", "all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_stored_activation(rng, op, scaling, recipe):
    """A stored activation (pk_jax.quantize_activation) through the kernels
    (fp8_dot, and each TP op on one rank, the FP8 host sequences included):
    the forward's bits of quantizing x inside the call; w's gradient the same
    bits with a tensor factor, within the recipe's bound of float32 with block
    factors; x's cotangent zero; outputs poisoned beforehand."""
    from jax.sharding import PartitionSpec as P
    mesh = gpu_mesh(1, "tp")
    m, k, n = 1024, 768, 1536
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    axis = "tp" if op == "all_gather_matmul" and scaling == "tensor" else None

    def call(stored: bool):
        def body(x, w):
            if op == "fp8_dot":
                return (pk_jax.fp8_dot(pk_jax.quantize_activation(x, scaling), w) if stored
                        else pk_jax.fp8_dot(x, w, recipe))
            fn = getattr(pk_jax, op)
            return (fn(pk_jax.quantize_activation(x, scaling, axis_name=axis), w, "tp")
                    if stored else fn(x, w, "tp", fp8=recipe))
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                          out_specs=P("tp"))
        loss = lambda w, x: jnp.sum(f(x, w).astype(jnp.float32) * t)
        poison_allocator(mesh, 16 * m * (k + n))
        return jax.jit(f)(x, w), jax.jit(jax.grad(loss))(w, x)

    (y8, dw8), (y, dw) = call(True), call(False)
    np.testing.assert_array_equal(np.asarray(y8, np.float32), np.asarray(y, np.float32))
    if scaling == "tensor":
        np.testing.assert_array_equal(np.asarray(dw8, np.float32), np.asarray(dw, np.float32))
    xf = np.asarray(x, np.float32)
    assert rel_err(y8, xf @ np.asarray(w, np.float32)) < FWD_TOL
    assert rel_err(dw8, xf.T @ np.asarray(t)) < GRAD_TOL
