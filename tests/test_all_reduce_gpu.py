"""pk_jax.all_reduce / reduce_scatter kernels on real GPUs, bit-exact against
the exact host sum (ranks in order, fp32 for 16-bit floats, one rounding),
so every rank's result is the same bits.

World size 1 runs on one GPU (the whole protocol with no peers: signals,
epochs, reduction kernel); the 2-GPU tests skip with a reason below two GPUs
(tests/scripts/gpu_all_reduce_check.py runs the same across two processes
sharing one GPU). Inputs are fresh random values; the allocator is poisoned first.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime
from pk_jax.ops.all_reduce.primitive import KERNEL_MECHANISMS
from helpers.all_reduce_checks import bits, exact_reduce_scatter, exact_sum, random_operand
from conftest import gpu_mesh
from helpers.gpu_util import poison_allocator

pytestmark = pytest.mark.gpu
MECHANISMS = [*KERNEL_MECHANISMS, "auto"]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]


def _needs_kernels():
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")


def _sm(mesh, fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def _check(mesh, rng, per_rank, dtype, mechanism, op="all_reduce", dim=0, tiled=True):
    _needs_kernels()
    n = mesh.devices.size
    shards = [random_operand(rng, per_rank, dtype) for _ in range(n)]
    x = jax.device_put(np.concatenate(shards), NamedSharding(mesh, P("x")))
    if op == "all_reduce":
        fn = lambda a: pk_jax.all_reduce(a, "x", mechanism=mechanism)
        want = np.concatenate([exact_sum(shards)] * n)
    else:
        fn = lambda a: pk_jax.reduce_scatter(a, "x", scatter_dimension=dim, tiled=tiled,
                                             mechanism=mechanism)
        # out_specs P("x"): the ranks' chunks stacked along axis 0
        want = np.concatenate([exact_reduce_scatter(shards, r, dim, tiled, n)
                               for r in range(n)], axis=0)
    f = _sm(mesh, fn)
    hlo = f.lower(x).as_text()
    assert "pk_all_reduce" in hlo, "the kernel was not lowered"
    poison_allocator(mesh, x.nbytes // n + 4096)
    got = np.asarray(f(x))
    np.testing.assert_array_equal(bits(got), bits(want))
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_world_size_one_all_reduce(rng, mechanism, dtype):
    _check(gpu_mesh(1), rng, (3001,), dtype, mechanism)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_world_size_one_reduce_scatter(rng, mechanism, dtype):
    _check(gpu_mesh(1), rng, (6, 10, 3), dtype, mechanism, op="reduce_scatter", dim=1)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_world_size_one_1000_calls_in_scan(mechanism):
    _needs_kernels()
    mesh = gpu_mesh(1)

    def chain(a):
        def body(c, i):
            s = pk_jax.all_reduce(c, "x", mechanism=mechanism)
            p = pk_jax.reduce_scatter(s, "x", mechanism=mechanism)
            return (p * 3 + c + i) % 100003, s[0]
        return lax.scan(body, a, jnp.arange(1000, dtype=jnp.int32))
    x = jax.device_put(np.arange(4096, dtype=np.int32), NamedSharding(mesh, P("x")))
    carry, firsts = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"),
                                          out_specs=(P("x"), P()), check_vma=False))(x)
    c = np.arange(4096, dtype=np.int64)
    want_firsts = []
    for i in range(1000):
        want_firsts.append(c[0])
        c = (c * 3 + c + i) % 100003
    np.testing.assert_array_equal(np.asarray(carry), c.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(firsts), np.asarray(want_firsts, np.int32))
    pk_jax.check_errors()


def test_world_size_one_graph_replays_on_fresh_buffers(rng):
    """The same compiled program on new inputs (CUDA graph updates: 1-D copies only)."""
    _needs_kernels()
    mesh = gpu_mesh(1)
    for mechanism in KERNEL_MECHANISMS:
        f = _sm(mesh, lambda a, m=mechanism: pk_jax.all_reduce(a * 2, "x", mechanism=m) + 1)
        for _ in range(4):
            host = random_operand(rng, (64, 33), jnp.float32)
            x = jax.device_put(host, NamedSharding(mesh, P("x")))
            np.testing.assert_array_equal(np.asarray(f(x)), host * 2 + 1)
    pk_jax.check_errors()


def test_fresh_buffers_under_command_buffers():
    """Every custom call in a CUDA graph (min graph size 1), called on new
    buffers: the graph is updated in place (1-D copies only). One or two GPUs."""
    gpu_mesh(1)
    _needs_kernels()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                          "gpu_all_reduce_check.py")
    proc = subprocess.run([sys.executable, script, "graphs"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "GRAPHS_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---- two GPUs --------------------------------------------------------------------------
SIZES = [(5,), (3, 40), (4096,), ((1 << 18) + 24,), (1 << 22,)]


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_two_gpus_all_reduce_bitwise(rng, mechanism, dtype, shape):
    _check(gpu_mesh(2), rng, shape, dtype, mechanism)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,tiled", [((8, 1024), 0, True), ((6, 10, 3), 1, True),
                                             ((4, 2, 9), 1, False), ((3, 4096), 1, True)])
def test_two_gpus_reduce_scatter_bitwise(rng, mechanism, dtype, shape, dim, tiled):
    _check(gpu_mesh(2), rng, shape, dtype, mechanism, op="reduce_scatter", dim=dim, tiled=tiled)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_two_gpus_interleaved_with_xla_psum(rng, mechanism):
    _needs_kernels()
    mesh = gpu_mesh(2)

    def body(reduce):
        def f(a):
            for _ in range(5):
                y = reduce(a, "x")
                s = lax.psum(y * 0.5, "x")
                a = (s + a) * 0.25
            return a
        return f

    x = jax.device_put(rng.standard_normal((2 * 4096,)).astype(np.float32),
                       NamedSharding(mesh, P("x")))
    ours = _sm(mesh, body(lambda a, ax: pk_jax.all_reduce(a, ax, mechanism=mechanism)))(x)
    ref = _sm(mesh, body(lax.psum))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_two_gpus_timeout_raises_and_recovers(rng, mechanism):
    _needs_kernels()
    mesh = gpu_mesh(2)
    x = jax.device_put(rng.standard_normal((2 * 1000,)).astype(np.float32),
                       NamedSharding(mesh, P("x")))
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            bad = _sm(mesh, lambda a: pk_jax.all_reduce(a, "x", mechanism=mechanism))
            out = np.asarray(bad(x))
        assert np.isnan(out[:1000]).all(), "the failed rank's result is poisoned"
        with pytest.raises(pk_jax.PkJaxTimeoutError, match=r"all_reduce.*rank 0\).*peer rank 1"):
            pk_jax.check_errors()
    _check(mesh, rng, (1000,), jnp.float32, mechanism)
