"""Dependent chains of every pk_jax op, checked against XLA: run inside the
GPU test process and again in a subprocess with XLA command buffers off
(tests/scripts/gpu_chains_check.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax


def gather_chain(gather, m, steps):
    """`steps` dependent all_gathers: each result feeds the next input."""
    def body(i, c):
        y = gather(c, "x", tiled=True)
        n = y.shape[0] // m
        r = lax.axis_index("x")
        nxt = lax.dynamic_slice_in_dim(y, ((r + 1) % n) * m, m)
        mine = lax.dynamic_slice_in_dim(y, r * m, m)
        return nxt * jnp.uint32(3) + mine + i.astype(jnp.uint32)
    return lambda c: lax.fori_loop(0, steps, body, c)


def check_all_gather_chain(mesh, mechanism, steps, m=1024):
    rng = np.random.default_rng()
    x = jax.device_put(rng.integers(0, 2**32, size=(mesh.size * m,), dtype=np.uint32),
                       NamedSharding(mesh, P("x")))
    run = lambda g: jax.jit(jax.shard_map(gather_chain(g, m, steps), mesh=mesh,
                                          in_specs=P("x"), out_specs=P("x"),
                                          check_vma=False))(x)
    ours = run(lambda a, ax, **k: pk_jax.all_gather(a, ax, mechanism=mechanism, **k))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(run(lax.all_gather)))
    pk_jax.check_errors()


def check_tp_chain(mesh, steps=20):
    """An MLP pair applied `steps` times in a fori_loop: pk's distance to the
    fp32 chain may be at most XLA's (bf16) distance plus a little. Rounding
    differences compound over the steps, so a fixed bound would not do."""
    rng = np.random.default_rng()
    put = lambda a, s: jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, s))
    x = put(rng.standard_normal((512, 256)), P("x"))
    w1 = put(rng.standard_normal((256, 512)) / 16, P(None, "x"))
    w2 = put(rng.standard_normal((512, 256)) / 22, P("x", None))

    def run(mechanism, *args):
        def body(x, w1, w2):
            def step(i, c):
                h = pk_jax.all_gather_matmul(c, w1, "x", mechanism=mechanism)
                return pk_jax.matmul_reduce_scatter(jnp.tanh(h), w2, "x", mechanism=mechanism)
            return lax.fori_loop(0, steps, step, x)
        return np.asarray(jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x", None)),
            out_specs=P("x")))(*args), np.float64)
    exact = run("xla", *(a.astype(jnp.float32) for a in (x, w1, w2)))
    rel = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)
    ours, xla = rel(run("chunked", x, w1, w2)), rel(run("xla", x, w1, w2))
    assert np.isfinite(ours) and ours <= 1.5 * xla + 1e-2, f"{ours=} {xla=}"
    pk_jax.check_errors()

