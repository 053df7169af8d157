"""pk_jax.all_gather kernels on real GPUs, bit-exact against lax.all_gather.

Skipped with a reason when there are too few GPUs. Inputs are fresh random
bit patterns every run and the allocator is poisoned before each call.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime
from pk_jax.ops.all_gather.primitive import KERNEL_MECHANISMS
from conftest import gpu_mesh
from helpers.gpu_chains import check_all_gather_chain
from helpers.gpu_util import as_bits, poison_allocator, put, random_bits

pytestmark = pytest.mark.gpu
MECHANISMS = list(KERNEL_MECHANISMS)
LL_MAX = 16 << 10  # ld_st_ll: whole 4-byte words, up to this many bytes per rank


def _ll_takes(shape, dtype, axis=0, tiled=False):
    dim = axis % (len(shape) + (0 if tiled else 1))
    row_bytes = int(np.prod(shape[dim:])) * np.dtype(dtype).itemsize
    return row_bytes % 4 == 0 and int(np.prod(shape)) * np.dtype(dtype).itemsize <= LL_MAX


def _cases(params, shape_of):
    """Every (mechanism, *param) pair the mechanism takes; ld_st_ll only on the
    sizes it supports (the others are the error test's business)."""
    return [(m, *p) for m in MECHANISMS for p in params
            if m != "ld_st_ll" or _ll_takes(*shape_of(*p))]


def _gather_fn(mesh, gather, **kw):
    f = jax.shard_map(lambda a: gather(a, "x", **kw), mesh=mesh, in_specs=P("x"),
                      out_specs=P("x"), check_vma=False)
    return jax.jit(f)


def _check(mesh, rng, local_shape, dtype, mechanism, **kw):
    n = mesh.devices.size
    host = random_bits(rng, (n * local_shape[0],) + tuple(local_shape[1:]), dtype)
    x = put(mesh, host, dtype)
    ref = _gather_fn(mesh, lax.all_gather, **kw)(x)
    ref.block_until_ready()
    poison_allocator(mesh, ref.nbytes // n + 4096)
    ours = _gather_fn(mesh, pk_jax.all_gather, mechanism=mechanism, **kw)(x)
    np.testing.assert_array_equal(as_bits(ours), as_bits(ref))
    pk_jax.check_errors()


# Per-rank message sizes from 4 bytes to 256 MiB (bytes, dtype).
SIZES = [(4, jnp.uint8), (4, jnp.float32), (6, jnp.bfloat16), (1000, jnp.float16),
         (8 << 10, jnp.bfloat16), ((1 << 20) + 24, jnp.float32), (16 << 20, jnp.int32),
         (64 << 20, jnp.bfloat16), (256 << 20, jnp.bfloat16)]


def _size_shape(nbytes, dtype):
    return (nbytes // np.dtype(dtype).itemsize,), dtype


@pytest.mark.parametrize("mechanism,nbytes,dtype", _cases(SIZES, _size_shape))
def test_sizes_bit_exact(rng, mechanism, nbytes, dtype):
    mesh = gpu_mesh(2)
    itemsize = np.dtype(dtype).itemsize
    _check(mesh, rng, (nbytes // itemsize,), dtype, mechanism)


AXIS_CASES = [(dtype, *layout)
              for dtype in (jnp.uint8, jnp.float16, jnp.float32, jnp.float64)
              for layout in [((6, 5, 7), 0, False), ((6, 5, 7), 1, False), ((6, 5, 7), 2, True),
                             ((4, 33), 1, True), ((4, 3, 2), -1, False), ((256, 128), 1, True)]]


@pytest.mark.parametrize("mechanism,dtype,shape,axis,tiled",
                         _cases(AXIS_CASES, lambda d, s, a, t: (s, d, a, t)))
def test_axes_and_dtypes(rng, mechanism, dtype, shape, axis, tiled):
    mesh = gpu_mesh(2)
    with jax.enable_x64(dtype == jnp.float64):
        _check(mesh, rng, shape, dtype, mechanism, axis=axis, tiled=tiled)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_world_size_one(rng, mechanism):
    mesh = gpu_mesh(1)
    _check(mesh, rng, (3000,), jnp.bfloat16, mechanism, tiled=True)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_thousand_calls_in_fori_loop(mechanism):
    check_all_gather_chain(gpu_mesh(2), mechanism, 1000, m=2048)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_interleaved_with_xla_psum(rng, mechanism):
    mesh = gpu_mesh(2)

    def body(gather):
        def f(a):
            for _ in range(5):
                y = gather(a, "x", tiled=True)
                s = lax.psum(y[: a.shape[0]], "x")
                a = (s + a) * 0.5
            return a
        return f

    x = put(mesh, rng.standard_normal((2 * 4096,)).astype(np.float32), jnp.float32)
    run = lambda g: jax.jit(jax.shard_map(body(g), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                          check_vma=False))(x)
    ours = run(lambda a, ax, **k: pk_jax.all_gather(a, ax, mechanism=mechanism, **k))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(run(lax.all_gather)))


def test_command_buffers_off():
    """The default run of this suite has XLA command buffers on; this one
    runs every op's chain again in a process with them off."""
    gpu_mesh(2)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                          "gpu_chains_check.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "SUBPROCESS_OK" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_timeout_raises_and_process_recovers(rng, mechanism):
    mesh = gpu_mesh(2)
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            bad = _gather_fn(mesh, pk_jax.all_gather, mechanism=mechanism, tiled=True)
            x = put(mesh, rng.standard_normal((2 * 1000,)).astype(np.float32), jnp.float32)
            bad(x).block_until_ready()  # returns: the waits are bounded
        with pytest.raises(pk_jax.PkJaxTimeoutError, match=r"rank 0\).*peer rank 1"):
            pk_jax.check_errors()
        pk_jax.check_errors()  # cleared
    good = _gather_fn(mesh, pk_jax.all_gather, mechanism=mechanism, tiled=True)
    x = put(mesh, rng.standard_normal((2 * 1000,)).astype(np.float32), jnp.float32)
    ref = _gather_fn(mesh, lax.all_gather, tiled=True)(x)
    np.testing.assert_array_equal(np.asarray(good(x)), np.asarray(ref))


def test_pending_error_fails_the_next_call(rng):
    mesh = gpu_mesh(2)
    x = put(mesh, rng.standard_normal((2 * 64,)).astype(np.float32), jnp.float32)
    try:
        with pk_jax.configured(timeout_s=0.2):
            with runtime.testing_skip_post(0):
                _gather_fn(mesh, pk_jax.all_gather, mechanism="ld_st_push")(x).block_until_ready()
            nxt = _gather_fn(mesh, pk_jax.all_gather, mechanism="ld_st_push", tiled=True)
            with pytest.raises(Exception, match="timed out"):
                nxt(x).block_until_ready()
    finally:
        with pytest.raises(pk_jax.PkJaxTimeoutError):
            pk_jax.check_errors()
    np.testing.assert_array_equal(
        np.asarray(_gather_fn(mesh, pk_jax.all_gather, mechanism="ld_st_push", tiled=True)(x)),
        np.asarray(_gather_fn(mesh, lax.all_gather, tiled=True)(x)))
