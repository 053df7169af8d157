"""all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce kernels on
GPUs against the fp32 reference of the unsharded product, with a tolerance set
by XLA's own same-precision result (matmul_all_reduce: also the same bits on
every rank). Skipped with a reason when there are too few GPUs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime
from pk_jax.ops.tp_matmul.primitive import ALL_REDUCE_KERNEL_MECHANISMS
from conftest import gpu_mesh, rel_err
from helpers.gpu_chains import check_tp_chain
from helpers.gpu_util import as_bits, poison_allocator
from helpers.tp_models import mlp_loss

pytestmark = pytest.mark.gpu

# (rows per rank, K, N per rank): square-ish, non-square, tall-skinny, ragged rows,
# and the forward GEMM's tile table on both sides of its bound (tile_table.h: 64
# tiles of 128x256 run 128x128 ping-pong tiles, 81 the 128x256 cooperative ones).
SHAPES = [(256, 512, 1024), (1024, 4096, 512), (4096, 256, 128), (100, 128, 256),
          (1024, 256, 2048), (1152, 256, 2304)]


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def _ag(mesh, mechanism, **kw):
    return jax.jit(jax.shard_map(
        lambda x, w: pk_jax.all_gather_matmul(x, w, "x", mechanism=mechanism, **kw),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))


def _rs(mesh, mechanism, **kw):
    return jax.jit(jax.shard_map(
        lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "x", mechanism=mechanism, **kw),
        mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x")))


def _check(ours, xla, exact, what):
    """Our error against fp32 may be at most XLA's same-precision error plus a
    little (different summation order), never NaN."""
    err, base = rel_err(ours, exact), rel_err(xla, exact)
    assert np.isfinite(err) and err <= 1.5 * base + 1e-3, f"{what}: {err=} {base=}"


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n_cols", SHAPES)
def test_all_gather_matmul(rng, n, dtype, m, k, n_cols):
    mesh = gpu_mesh(n)
    x = rng.standard_normal((n * m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n * n_cols)) / np.sqrt(k)).astype(np.float32)
    xs, ws = _put(mesh, x.astype(dtype), P("x")), _put(mesh, w.astype(dtype), P(None, "x"))
    exact = np.asarray(xs, np.float32) @ np.asarray(ws, np.float32)
    xla = _ag(mesh, "xla")(xs, ws)
    poison_allocator(mesh, exact.size * 2 // n + 4096)
    _check(_ag(mesh, "chunked")(xs, ws), xla, exact, "all_gather_matmul")
    pk_jax.check_errors()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
# + an N that is not a multiple of the GEMM's 256-column tile.
@pytest.mark.parametrize("m,k,n_cols", SHAPES + [(128, 256, 200)])
def test_matmul_reduce_scatter(rng, n, dtype, m, k, n_cols):
    mesh = gpu_mesh(n)
    x = rng.standard_normal((n * m, n * k)).astype(np.float32)
    w = (rng.standard_normal((n * k, n_cols)) / np.sqrt(n * k)).astype(np.float32)
    xs, ws = _put(mesh, x.astype(dtype), P(None, "x")), _put(mesh, w.astype(dtype), P("x"))
    exact = np.asarray(xs, np.float32) @ np.asarray(ws, np.float32)
    xla = _rs(mesh, "xla")(xs, ws)
    poison_allocator(mesh, exact.size * 2 // n + 4096)
    # twice: the second call reuses the channel (next epoch, flags already set once)
    for _ in range(2):
        _check(_rs(mesh, "chunked")(xs, ws), xla, exact, "matmul_reduce_scatter")
    pk_jax.check_errors()


def test_fp32_output_and_gathered(rng):
    mesh = gpu_mesh(2)
    x = _put(mesh, jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16), P("x"))
    w = _put(mesh, jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.bfloat16), P(None, "x"))
    f = jax.jit(jax.shard_map(
        lambda a, b: pk_jax.all_gather_matmul(a, b, "x", return_gathered=True,
                                              preferred_element_type=jnp.float32),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=(P(None, "x"), P("x")),
        check_vma=False))
    out, gathered = f(x, w)
    assert out.dtype == jnp.float32
    # every device gathered all rows: the per-device copies stack to n x the input
    np.testing.assert_array_equal(np.asarray(gathered[:512]), np.asarray(x))
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(out, exact) < 1e-5  # fp32 output: only the bf16 inputs' rounding is left


def test_mlp_gradients(rng):
    mesh = gpu_mesh(2)
    d, h = 512, 2048
    x = _put(mesh, jnp.asarray(rng.standard_normal((1024, d)), jnp.bfloat16), P("x"))
    w1 = _put(mesh, jnp.asarray(rng.standard_normal((d, h)) / np.sqrt(d), jnp.bfloat16),
              P(None, "x"))
    w2 = _put(mesh, jnp.asarray(rng.standard_normal((h, d)) / np.sqrt(h), jnp.bfloat16),
              P("x", None))
    grads = lambda pk, *a: jax.jit(jax.grad(lambda *b: mlp_loss(mesh, "x", pk, *b),
                                            (0, 1, 2)))(*a)
    exact = grads(False, *(a.astype(jnp.float32) for a in (x, w1, w2)))
    xla = grads(False, x, w1, w2)
    ours = grads(True, x, w1, w2)
    for o, r, e in zip(ours, xla, exact):
        _check(o, r, e, "mlp gradient")
    pk_jax.check_errors()


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m", [512, 100])
def test_op_gradients(rng, op, n, dtype, m):
    """jax.grad of each op alone (its backward is one call: the other op's
    sequence with w^T read in place, and the dW GEMM reading the activations
    transposed in place) against the fp32 gradient of the XLA version; m
    rows per rank, 100 off every tile."""
    mesh = gpu_mesh(n)
    k, n_cols = 1024, 768  # per rank; non-square
    ag = op == "all_gather_matmul"
    x_spec, w_spec, out_spec = ((P("x"), P(None, "x"), P(None, "x")) if ag
                                else (P(None, "x"), P("x", None), P("x")))
    x_shape = (n * m, k) if ag else (n * m, n * k)
    w_shape = (k, n * n_cols) if ag else (n * k, n_cols)
    x = _put(mesh, jnp.asarray(rng.standard_normal(x_shape), dtype), x_spec)
    w = _put(mesh, jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(k), dtype), w_spec)
    t = _put(mesh, jnp.asarray(rng.standard_normal((n * m, n_cols * (n if ag else 1))),
                               jnp.float32), out_spec)  # the output's cotangent

    def grads(mechanism, x, w):
        f = jax.shard_map(lambda x, w: getattr(pk_jax, op)(x, w, "x", mechanism=mechanism),
                          mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t)
        return jax.jit(jax.grad(loss, (0, 1)))(x, w)

    exact = grads("xla", x.astype(jnp.float32), w.astype(jnp.float32))
    xla = grads("xla", x, w)
    poison_allocator(mesh, 4 * m * k * 4)
    ours = grads("chunked", x, w)
    for name, o, r, e in zip(("dx", "dw"), ours, xla, exact):
        assert o.dtype == dtype and o.shape == e.shape, f"{name}: {o.dtype} {o.shape}"
        _check(o, r, e, f"{op} n={n} {jnp.dtype(dtype).name} {name}")
    pk_jax.check_errors()


@pytest.mark.parametrize("n", [1, 2])
def test_mlp_backward_is_one_call_per_op(rng, n):
    """The compiled MLP gradient: each op's backward is one pk call computing
    dx and dw; no XLA dot (cuBLAS or Triton) is left for the weight
    gradients."""
    mesh = gpu_mesh(n)
    d, h = 256, 512 * n
    args = [_put(mesh, jnp.asarray(rng.standard_normal(s) / 8, jnp.bfloat16), p)
            for s, p in (((128 * n, d), P("x")), ((d, h), P(None, "x")), ((h, d), P("x", None)))]
    # "chunked": on one device `auto` runs XLA's dot (tuning.single_gpu_gemm)
    grad = jax.jit(jax.grad(lambda *b: mlp_loss(mesh, "x", True, *b, mechanism="chunked"),
                            (0, 1, 2)))
    hlo = grad.lower(*args).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    for t in ("pk_all_gather_matmul_bwd", "pk_matmul_reduce_scatter_bwd"):
        assert targets.count(t) == 1, targets
    assert not any("cublas" in t or "gemm" in t for t in targets), targets
    assert " dot(" not in hlo
    xla = jax.jit(jax.grad(lambda *b: mlp_loss(mesh, "x", False, *b), (0, 1, 2)))
    xla_hlo = xla.lower(*args).compile().as_text()
    assert " dot(" in xla_hlo or "cublas" in xla_hlo  # the check can fail


def test_backward_with_fp32_output_takes_two_steps(rng):
    """An fp32 output gives an fp32 dy (bf16 operands): the two-step
    backward, with the right gradients."""
    mesh = gpu_mesh(1)
    x = _put(mesh, jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16), P("x"))
    w = _put(mesh, jnp.asarray(rng.standard_normal((512, 384)) / 22, jnp.bfloat16), P(None, "x"))
    t = _put(mesh, jnp.asarray(rng.standard_normal((256, 384)), jnp.float32), P(None, "x"))

    def grads(mechanism, x, w):
        f = jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(
            x, w, "x", mechanism=mechanism, preferred_element_type=jnp.float32),
            mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * t), (0, 1)))(x, w)

    exact = grads("xla", x.astype(jnp.float32), w.astype(jnp.float32))
    for name, o, r, e in zip(("dx", "dw"), grads("chunked", x, w), grads("xla", x, w), exact):
        _check(o, r, e, f"fp32-output {name}")
    pk_jax.check_errors()


def test_repeated_in_scan(rng):
    mesh = gpu_mesh(2)
    w1 = _put(mesh, jnp.asarray(rng.standard_normal((256, 512)) / 16, jnp.bfloat16), P(None, "x"))
    w2 = _put(mesh, jnp.asarray(rng.standard_normal((512, 256)) / 22, jnp.bfloat16), P("x", None))
    x = _put(mesh, jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16), P("x"))

    def run(mechanism, *args):
        def body(x, w1, w2):
            def step(c, _):
                h = pk_jax.all_gather_matmul(c, w1, "x", mechanism=mechanism)
                return pk_jax.matmul_reduce_scatter(jnp.tanh(h), w2, "x",
                                                    mechanism=mechanism), None
            return lax.scan(step, x, None, length=50)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x"),
                                                                 P("x", None)),
                                     out_specs=P("x")))(*args)
    # Rounding differences compound over 50 steps: our distance to the fp32
    # chain may be at most XLA's (bf16) plus a little. (Against XLA's bf16
    # chain directly, a kernel that rounds less, as the two-rank
    # reduce-scatter's epilogue sum does, would look wrong.)
    exact = run("xla", *(a.astype(jnp.float32) for a in (x, w1, w2)))
    ours = rel_err(run("chunked", x, w1, w2), exact)
    xla = rel_err(run("xla", x, w1, w2), exact)
    assert np.isfinite(ours) and ours <= 1.5 * xla + 1e-2, f"{ours=} {xla=}"
    pk_jax.check_errors()


def test_chain_in_fori_loop():
    check_tp_chain(gpu_mesh(2), steps=100)


def test_timeout_raises(rng):
    mesh = gpu_mesh(2)
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            x = _put(mesh, jnp.ones((256, 128), jnp.bfloat16), P("x"))
            w = _put(mesh, jnp.ones((128, 256), jnp.bfloat16), P(None, "x"))
            _ag(mesh, "chunked")(x, w).block_until_ready()
        with pytest.raises(pk_jax.PkJaxTimeoutError, match="all_gather_matmul.*peer rank 1"):
            pk_jax.check_errors()


def test_reduce_scatter_timeout_raises():
    """A rank that never posts its partial sums: the peer's wait gives up,
    the error names the op and the peer, and once cleared the next call is
    right."""
    mesh = gpu_mesh(2)
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            x = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P(None, "x"))
            w = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P("x", None))
            _rs(mesh, "chunked")(x, w).block_until_ready()
        with pytest.raises(pk_jax.PkJaxTimeoutError, match="matmul_reduce_scatter.*peer rank 1"):
            pk_jax.check_errors()
    x = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P(None, "x"))
    w = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P("x", None))
    np.testing.assert_array_equal(np.asarray(_rs(mesh, "chunked")(x, w), np.float32), 256.0)
    pk_jax.check_errors()


# ---- matmul_all_reduce -----------------------------------------------------------
def _ar(mesh, mechanism, stacked=False, **kw):
    """psum(x @ w); `stacked`: every device's copy of the result, [n, M, N]
    (so that the ranks' bits can be compared)."""
    def body(x, w):
        y = pk_jax.matmul_all_reduce(x, w, "x", mechanism=mechanism, **kw)
        return y[None] if stacked else y
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                                 out_specs=P("x") if stacked else P(), check_vma=not stacked))


# (M, K per rank, N): decode-sized, square-ish, an N off the 256-column tile,
# and 2 x 2048 rows (two ranks' chunked sequence then pushes two pieces).
AR_SHAPES = [(16, 1024, 1024), (256, 512, 2048), (1024, 1024, 512), (512, 256, 200),
             (4096, 256, 512)]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mechanism", [*ALL_REDUCE_KERNEL_MECHANISMS, "auto"])
@pytest.mark.parametrize("m,k,n_cols", AR_SHAPES)
def test_matmul_all_reduce(rng, n, dtype, mechanism, m, k, n_cols):
    """Close to the fp32 product (as XLA's dot + psum is), and the same bits
    on every rank."""
    mesh = gpu_mesh(n)
    x = rng.standard_normal((m, n * k)).astype(np.float32)
    w = (rng.standard_normal((n * k, n_cols)) / np.sqrt(n * k)).astype(np.float32)
    xs, ws = _put(mesh, x.astype(dtype), P(None, "x")), _put(mesh, w.astype(dtype), P("x"))
    exact = np.asarray(xs, np.float32) @ np.asarray(ws, np.float32)
    xla = _ar(mesh, "xla")(xs, ws)
    poison_allocator(mesh, 2 * exact.size * 2 + 4096)
    for _ in range(2):  # the second call reuses the channels (next epoch)
        copies = np.asarray(_ar(mesh, mechanism, stacked=True)(xs, ws))
        assert copies.shape == (n, m, n_cols) and copies.dtype == dtype
        _check(copies[0], xla, exact, f"matmul_all_reduce {mechanism}")
        for r in range(1, n):
            np.testing.assert_array_equal(as_bits(copies[r]), as_bits(copies[0]),
                                          err_msg=f"rank {r} differs from rank 0")
    pk_jax.check_errors()


def test_matmul_all_reduce_fp32_output(rng):
    mesh = gpu_mesh(2)
    x = _put(mesh, jnp.asarray(rng.standard_normal((512, 512)), jnp.bfloat16), P(None, "x"))
    w = _put(mesh, jnp.asarray(rng.standard_normal((512, 256)) / 22, jnp.bfloat16), P("x"))
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    for mechanism in ALL_REDUCE_KERNEL_MECHANISMS:
        out = _ar(mesh, mechanism, preferred_element_type=jnp.float32)(x, w)
        assert out.dtype == jnp.float32
        assert rel_err(out, exact) < 1e-5, mechanism  # only the inputs' rounding is left
    pk_jax.check_errors()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mechanism", list(ALL_REDUCE_KERNEL_MECHANISMS))
def test_matmul_all_reduce_gradients(rng, n, mechanism):
    """jax.grad against lax.psum(x @ w)'s, in fp32 and bf16."""
    mesh = gpu_mesh(n)
    m, k, n_cols = 256, 512, 768
    x = _put(mesh, jnp.asarray(rng.standard_normal((m, n * k)), jnp.bfloat16), P(None, "x"))
    w = _put(mesh, jnp.asarray(rng.standard_normal((n * k, n_cols)) / 32, jnp.bfloat16),
             P("x", None))
    t = jnp.asarray(rng.standard_normal((m, n_cols)), jnp.float32)

    def grads(mechanism, x, w):
        loss = lambda x, w: jnp.sum(_ar(mesh, mechanism)(x, w).astype(jnp.float32) * t)
        return jax.jit(jax.grad(loss, (0, 1)))(x, w)
    exact = grads("xla", x.astype(jnp.float32), w.astype(jnp.float32))
    xla = grads("xla", x, w)
    for name, o, r, e in zip(("dx", "dw"), grads(mechanism, x, w), xla, exact):
        assert o.dtype == jnp.bfloat16 and o.shape == e.shape, f"{name}: {o.dtype} {o.shape}"
        _check(o, r, e, f"matmul_all_reduce {mechanism} n={n} {name}")
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", list(ALL_REDUCE_KERNEL_MECHANISMS))
def test_matmul_all_reduce_in_scan(rng, mechanism):
    """200 calls in a lax.scan, each on the previous result (a decode loop)."""
    mesh = gpu_mesh(2)
    w = _put(mesh, jnp.asarray(rng.standard_normal((512, 512)) / 16, jnp.bfloat16), P("x"))
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)

    def run(mechanism, x, w):
        def body(x, w):
            def step(c, _):  # c replicated; this rank's share of the features
                i = lax.axis_index("x")
                part = lax.dynamic_slice_in_dim(jnp.tanh(c), i * 256, 256, axis=1)
                return pk_jax.matmul_all_reduce(part, w, "x", mechanism=mechanism), None
            return lax.scan(step, x, None, length=200)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x", None)),
                                     out_specs=P()))(x, w)
    exact = run("xla", x.astype(jnp.float32), w.astype(jnp.float32))
    ours = rel_err(run(mechanism, x, w), exact)
    xla = rel_err(run("xla", x, w), exact)
    assert np.isfinite(ours) and ours <= 1.5 * xla + 1e-2, f"{ours=} {xla=}"
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", list(ALL_REDUCE_KERNEL_MECHANISMS))
def test_matmul_all_reduce_timeout_raises_and_poisons(mechanism):
    """A rank that never posts: the peer's wait gives up, its output is NaN
    (never plausible numbers), the error names the op and the peer, and once
    cleared the next call is right."""
    mesh = gpu_mesh(2)
    x = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P(None, "x"))
    w = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P("x", None))
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            copies = np.asarray(_ar(mesh, mechanism, stacked=True)(x, w), np.float32)
        assert np.isnan(copies[0]).all(), "rank 0 waited in vain: its output must be poison"
        with pytest.raises(pk_jax.PkJaxTimeoutError, match="matmul_all_reduce.*peer rank 1"):
            pk_jax.check_errors()
    np.testing.assert_array_equal(np.asarray(_ar(mesh, mechanism)(x, w), np.float32), 256.0)
    pk_jax.check_errors()
