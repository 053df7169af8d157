"""all_gather_matmul / matmul_reduce_scatter on 8 fake CPU devices: values
and gradients against the unsharded computation, shapes, and input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import pk_jax
from conftest import cpu_mesh, rel_err
from tp_models import mlp_loss


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _ag_fn(mesh, **kw):
    return jax.jit(jax.shard_map(lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", **kw),
                                 mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=P(None, "tp")))


def _rs_fn(mesh, **kw):
    return jax.jit(jax.shard_map(lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "tp", **kw),
                                 mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                 out_specs=P("tp")))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_gather_matmul_values(rng, n, dtype):
    mesh = cpu_mesh((n,), ("tp",))
    x, w = _normal(rng, (16 * n, 24), dtype), _normal(rng, (24, 8 * n), dtype)
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(_ag_fn(mesh)(x, w), ref) < (1e-6 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_matmul_reduce_scatter_values(rng, n):
    mesh = cpu_mesh((n,), ("tp",))
    x, w = _normal(rng, (8 * n, 16 * n)), _normal(rng, (16 * n, 24))
    out = _rs_fn(mesh)(x, w)
    assert out.shape == (8 * n, 24)
    assert rel_err(out, np.asarray(x) @ np.asarray(w)) < 1e-6


def test_batch_dims_and_gathered(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _normal(rng, (8, 3, 16)), _normal(rng, (16, 32))
    f = jax.jit(jax.shard_map(
        lambda a, b: pk_jax.all_gather_matmul(a, b, "tp", return_gathered=True),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=(P(None, None, "tp"), P()),
        check_vma=False))
    out, gathered = f(x, w)
    assert out.shape == (8, 3, 32) and gathered.shape == (8, 3, 16)
    np.testing.assert_array_equal(gathered, x)
    assert rel_err(out, np.einsum("bsk,kn->bsn", x, w)) < 1e-6


def test_preferred_element_type(rng):
    mesh = cpu_mesh((2,), ("tp",))
    x, w = _normal(rng, (8, 16), jnp.bfloat16), _normal(rng, (16, 16), jnp.bfloat16)
    assert _ag_fn(mesh, preferred_element_type=jnp.float32)(x, w).dtype == jnp.float32
    assert _rs_fn(mesh, preferred_element_type=jnp.float32)(x, w).dtype == jnp.float32


def test_mlp_pair_gradients_match_xla(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w1, w2 = _normal(rng, (32, 16)), _normal(rng, (16, 64)), _normal(rng, (64, 16))
    grad = lambda pk: jax.jit(jax.grad(lambda *a: mlp_loss(mesh, "tp", pk, *a), (0, 1, 2)))(
        x, w1, w2)
    for ours, ref in zip(grad(True), grad(False)):
        assert rel_err(ours, ref) < 1e-5


def test_gradient_through_gathered_output(rng):
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _normal(rng, (16, 8)), _normal(rng, (8, 16))

    def loss(pk, x, w):
        def body(x, w):
            if pk:
                out, g = pk_jax.all_gather_matmul(x, w, "tp", return_gathered=True)
            else:
                g = lax.all_gather(x, "tp", tiled=True)
                out = g @ w
            return jnp.sum(out ** 2)[None] + jnp.sum(jnp.cos(g))[None]
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
        return jnp.sum(f(x, w))

    for ours, ref in zip(jax.grad(lambda *a: loss(True, *a), (0, 1))(x, w),
                         jax.grad(lambda *a: loss(False, *a), (0, 1))(x, w)):
        assert rel_err(ours, ref) < 1e-5


def test_repeated_calls_in_scan(rng):
    mesh = cpu_mesh((4,), ("tp",))
    w1, w2 = _normal(rng, (16, 32)) / 4, _normal(rng, (32, 16)) / 6

    def run(pk):
        def body(x, w1, w2):
            def step(c, _):
                if pk:
                    h = pk_jax.all_gather_matmul(c, w1, "tp")
                    return pk_jax.matmul_reduce_scatter(jnp.tanh(h), w2, "tp"), None
                h = lax.all_gather(c, "tp", tiled=True) @ w1
                return lax.psum_scatter(jnp.tanh(h) @ w2, "tp", tiled=True), None
            return lax.scan(step, x, None, length=6)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"),
                                                                 P("tp", None)),
                                     out_specs=P("tp")))
    x = _normal(rng, (16, 16))
    assert rel_err(run(True)(x, w1, w2), run(False)(x, w1, w2)) < 1e-5


@pytest.mark.parametrize("call,match,error", [
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((6, 8)), "tp"),
     "contraction mismatch", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 8), jnp.int32),
                                      "tp"), "floating point", TypeError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((8,)), jnp.ones((8, 8)), "tp"),
     "expected x", ValueError),
    (lambda: pk_jax.matmul_reduce_scatter(jnp.ones((3, 8)), jnp.ones((8, 8)), "tp"),
     "must divide", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((0, 8)), jnp.ones((8, 8)), "tp"),
     "empty operands", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp", mechanism="nccl"),
     "mechanism must be", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8)), jnp.ones((8, 8)), "tp",
                                      mechanism="chunked"), "bf16 or fp16", ValueError),
    (lambda: pk_jax.all_gather_matmul(jnp.ones((4, 8), jnp.bfloat16),
                                      jnp.ones((8, 8), jnp.bfloat16), "tp", mechanism="fused"),
     "mechanism must be", ValueError),
    (lambda: pk_jax.matmul_reduce_scatter(jnp.ones((256, 8), jnp.bfloat16),
                                          jnp.ones((8, 8), jnp.bfloat16), "tp",
                                          mechanism="fused"), "mechanism must be", ValueError),
])
def test_bad_input(call, match, error):
    mesh = cpu_mesh((2,), ("tp",))
    f = jax.shard_map(lambda: call(), mesh=mesh, in_specs=(), out_specs=P(), check_vma=False)
    with pytest.raises(error, match=match):
        jax.jit(f)()
