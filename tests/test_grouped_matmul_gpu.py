"""pk_jax.grouped_matmul's kernel on one GPU against a float64 dense reference
and XLA's ragged_dot at the same precision, outputs poisoned first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from conftest import gpu_mesh, rel_err
from helpers.gpu_util import poison_allocator
from helpers.grouped_matmul_cases import CASES, dense, dense_grads, inputs

pytestmark = pytest.mark.gpu

# + MoE-sized: 8 experts of a 4096-row batch (one empty, one large), fp16.
GPU_CASES = CASES + [(4096, 1024, 512, [700, 0, 1900, 13, 400, 1, 1000, 82])]


def _run(mechanism, x, w, s, t):
    f = lambda x, w: pk_jax.grouped_matmul(x, w, s, mechanism=mechanism)
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t)
    out = jax.jit(f)(x, w)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    return out, dx, dw


@pytest.mark.parametrize("m,k,n,sizes", GPU_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_values_and_gradients(rng, m, k, n, sizes, dtype):
    mesh = gpu_mesh(1)
    x, w, t = inputs(rng, m, k, n, len(sizes), dtype)
    x, w, s, t = jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), jnp.asarray(t)
    hlo = jax.jit(lambda x, w: pk_jax.grouped_matmul(x, w, s, mechanism="kernel")).lower(
        x, w).as_text()
    assert "pk_grouped_matmul" in hlo  # the kernel, not a fallback
    want = (dense(x, w, sizes), *dense_grads(x, w, sizes, t))
    xla = _run("xla", x, w, s, t)
    poison_allocator(mesh, 4 * (m * k + m * n + len(sizes) * k * n) * 2)
    ours = _run("kernel", x, w, s, t)
    for name, o, r, e in zip(("out", "dx", "dw"), ours, xla, want):
        err, base = rel_err(o, e), rel_err(r, e)
        assert o.dtype == dtype and np.isfinite(err) and err <= 1.5 * base + 1e-3, \
            f"{name}: {err=} {base=}"
    used = 0
    for v in sizes:
        used += min(max(v, 0), m - used)
    assert not np.any(np.asarray(ours[0], np.float32)[used:])  # zeros, not poison
    for g, v in enumerate(sizes):
        if v <= 0:
            assert not np.any(np.asarray(ours[2][g], np.float32))


def test_float32_result(rng):
    mesh = gpu_mesh(1)
    m, k, n, sizes = GPU_CASES[-1]
    x, w, _ = inputs(rng, m, k, n, len(sizes), jnp.bfloat16)
    s = jnp.asarray(sizes, jnp.int32)
    poison_allocator(mesh, 4 * m * n)
    out = jax.jit(lambda x, w: pk_jax.grouped_matmul(
        x, w, s, preferred_element_type=jnp.float32, mechanism="kernel"))(x, w)
    assert out.dtype == jnp.float32 and rel_err(out, dense(x, w, sizes)) < 1e-4


def test_repeated_in_scan(rng):
    """Ten calls in a scan (one compiled program, maybe a command buffer):
    each step's sizes differ, every step right."""
    gpu_mesh(1)
    m, k, n, g = 512, 128, 64, 4
    x, w, _ = inputs(rng, m, k, n, g, jnp.bfloat16)
    sizes = rng.integers(0, 200, (10, g)).astype(np.int32)

    def step(c, s):
        return c, pk_jax.grouped_matmul(x, w, s, mechanism="kernel")

    _, outs = jax.jit(lambda s: jax.lax.scan(step, 0, s))(jnp.asarray(sizes))
    for i in range(10):
        assert rel_err(outs[i], dense(x, w, sizes[i])) < 1e-2, i
