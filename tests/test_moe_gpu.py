"""moe_dispatch / moe_combine, pk_jax.flax.MoE and examples/moe.py on a GPU.

Every mechanism: "ld_st" (pk's exchange kernel, xla_ffi/moe.cc), "ragged"
(the real jax.lax.ragged_all_to_all, which XLA:CPU lacks), "xla" and "auto"
(on one GPU the one-device row kernels, on two the exchange kernel), against
the dense reference's values and gradients, outputs poisoned beforehand; the
one-device layout kernel against its XLA reference bit for bit; the example
and the benchmark run. One GPU is a world-size-1 expert axis; two
GPUs (if present) a 2-rank one. Two processes sharing one GPU:
tests/scripts/gpu_multiprocess_check.py. Skipped without GPUs.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime
from pk_jax.ops.moe import MECHANISMS
from conftest import gpus, rel_err
from helpers.gpu_util import poison_allocator
from test_moe_cpu import _dense, _inputs, _kept_mask, np_local_layout, random_ids

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mesh():
    devices = gpus()
    if not devices:
        pytest.skip("needs a GPU")
    n = 2 if len(devices) >= 2 else 1
    return Mesh(np.array(devices[:n]), ("ep",), axis_types=(AxisType.Explicit,))


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("k,capacity", [(1, None), (2, None), (8, None), (2, 3)])
def test_values_and_gradients(rng, mechanism, k, capacity):
    mesh = _mesh()
    if mechanism == "ld_st" and not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")
    n, t, e = mesh.shape["ep"], 64, 16
    ids = np.stack([rng.choice(6, k, replace=False) if k <= 6 else rng.permutation(e)[:k]
                    for _ in range(n * t)])           # hot experts: capacity drops some
    x, ids, w, wts = _inputs(rng, n, t, k, 32, e, ids=ids)
    keep = _kept_mask(ids, n, t, k, e, capacity or n * t * k)

    def body(x, ids, w, wts):
        rows, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=e, capacity=capacity,
                                        mechanism=mechanism)
        out = pk_jax.moe_combine(lax.ragged_dot(rows, wts, lay.group_sizes), w, lay)
        return out, lay.num_dropped[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4,
                              out_specs=(P("ep"), P("ep"))))
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w, wts)]
    with jax.set_mesh(mesh), jax.default_matmul_precision("float32"):
        for _ in range(2):  # a second call: the channel's epochs advance
            poison_allocator(mesh, 64 << 20)
            out, dropped = f(*args)
        g = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, args[1], b, args[3])[0] ** 2),
                             argnums=(0, 1)))(args[0], args[2])
    masked = jnp.where(keep, w, 0)
    assert int(np.asarray(dropped).sum()) == int((~keep).sum())
    assert rel_err(out, _dense(x, ids, masked, wts, e)) < 1e-3
    g_ref = jax.grad(lambda a, b: jnp.sum(_dense(a, ids, jnp.where(keep, b, 0), wts, e) ** 2),
                     argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-3
    pk_jax.check_errors()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("cols", [7168, 36, 5])   # 16-byte vectors; narrower rows
def test_one_device_row_kernels_match_reference(rng, dtype, cols):
    """pk_moe_scatter_rows and pk_moe_weighted_sum on the GPU against their
    XLA references (ops/moe/primitive.py) on fresh random rows and a random
    partial layout (slots without a row, rows without a slot, indices out of
    range), outputs poisoned beforehand: the scatter bit for bit, the fp32
    sum to rounding."""
    mesh = _mesh()
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")
    from pk_jax.ops.moe import primitive as mp
    t, k, rows = 96, 3, 200
    src = jnp.asarray(rng.standard_normal((t, cols)), dtype)
    y = jnp.asarray(rng.standard_normal((rows, cols)), dtype)
    kept = rng.permutation(t * k)[:150]                       # slots with a row
    dest = np.full(t * k, -1, np.int32)
    dest[kept] = rng.permutation(rows)[:150]
    row_slot = np.full(rows, -1, np.int32)
    row_slot[dest[kept]] = kept
    dest[rng.choice(np.flatnonzero(dest < 0), 2)] = rows + 3  # out of range: no row
    row_slot[np.flatnonzero(row_slot < 0)[:2]] = t * k + 5    # out of range: zeros
    dest, row_slot = jnp.asarray(dest), jnp.asarray(row_slot)
    row_of_slot = jnp.asarray(rng.integers(-2, rows + 3, t * k), jnp.int32)
    scale = jnp.asarray(rng.random(t * k), jnp.float32)
    scatter = jax.jit(lambda s, d, r, c: mp.scatter_rows(s, d, r, k, c))
    summed = jax.jit(lambda s, i, w: mp.weighted_sum(s, i, w, t))
    plain = jax.jit(lambda s, i: mp.weighted_sum(s, i, None, t))
    assert "pk_moe_scatter_rows" in scatter.lower(src, dest, row_slot, scale).compile().as_text()
    poison_allocator(mesh, 64 << 20)
    got = [scatter(src, dest, row_slot, scale), summed(y, row_of_slot, scale),
           plain(y, row_of_slot)]
    want = [mp.reference_scatter_rows(src, dest, row_slot, scale, repeat=k, scaled=True),
            mp.reference_weighted_sum(y, row_of_slot, scale, tokens=t, weighted=True),
            mp.reference_weighted_sum(y, row_of_slot, None, tokens=t, weighted=False)]
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for a, b in zip(got[1:], want[1:]):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_err(a, b) < (1e-6 if dtype == jnp.float32 else 4e-3)


def _layout_fns(e, capacity, rows):
    """(the layout primitive, its XLA reference), each jitted for the GPU."""
    from pk_jax.ops.moe import primitive as mp
    return (jax.jit(lambda ids: mp.local_layout(ids, e, capacity, rows)),
            jax.jit(lambda ids: mp.reference_layout(ids, num_experts=e, capacity=(
                -1 if capacity is None else capacity), num_rows=rows)))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("e", [1, 8, 64, 255])
@pytest.mark.parametrize("s", [1, 31, 1024, 1025, 8192, 65536])
def test_layout_kernel_matches_reference(rng, s, e, capped, dtype):
    """pk_moe_layout (one block) against its XLA reference on the GPU, bit
    for bit, outputs poisoned beforehand: fresh random ids with invalid ones
    (negative, >= E, beyond 2^32 for int64), half on 3 hot experts (capacity
    drops), slot counts from one to the kernel's bound across its 1024-slot
    steps, E up to its bound; and the numpy layout."""
    mesh = _mesh()
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")
    capacity = max(1, s // (2 * e)) if capped else None
    rows = s if capacity is None else e * capacity
    with jax.enable_x64(dtype == np.int64):
        ids = jnp.asarray(random_ids(rng, s, e, dtype))
        kernel, reference = _layout_fns(e, capacity, rows)
        assert "pk_moe_layout" in kernel.lower(ids).compile().as_text()
        assert "pk_moe_layout" not in reference.lower(ids).compile().as_text()
        poison_allocator(mesh, 64 << 20)
        got, want = kernel(ids), reference(ids)
        for a, b, c in zip(got, want, np_local_layout(np.asarray(ids), e, capacity, rows)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(a), c)
    pk_jax.check_errors()


@pytest.mark.parametrize("capped", [False, True])
def test_layout_above_the_bound_is_xla(rng, capped):
    """One slot past the kernel's bound the layout is XLA's, and agrees with
    numpy."""
    _mesh()
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")
    from pk_jax.ops.moe import primitive as mp
    s, e = mp.LAYOUT_MAX_SLOTS + 1, 8
    capacity = s // 16 if capped else None
    rows = s if capacity is None else e * capacity
    ids = jnp.asarray(random_ids(rng, s, e))
    fn = _layout_fns(e, capacity, rows)[0]
    assert "pk_moe_layout" not in fn.lower(ids).compile().as_text()
    for a, b in zip(fn(ids), np_local_layout(np.asarray(ids), e, capacity, rows)):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("t,k,e", [(4096, 2, 8), (128, 8, 8)])
def test_local_dispatch_is_the_layout_and_scatter_kernels(t, k, e):
    """On one GPU moe_dispatch compiles to the layout kernel and the row
    scatter: no sort, scatter or reduction of XLA's is left on its path."""
    mesh = Mesh(np.array(_mesh().devices.reshape(-1)[:1]), ("ep",),
                axis_types=(AxisType.Explicit,))
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")

    def body(x, ids):
        return pk_jax.moe_dispatch(x, ids, "ep", num_experts=e)[0]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))
            for shape, dtype in (((t, 256), jnp.bfloat16), ((t, k), jnp.int32))]
    with jax.set_mesh(mesh):
        text = f.trace(*args).lower().compile().as_text()
    assert "pk_moe_layout" in text and "pk_moe_scatter_rows" in text
    assert not re.search(r"\b(sort|scatter|reduce)\(", text), text


def test_ld_st_takes_the_kernel():
    """With the extension built, mechanism="ld_st" compiles to pk's custom call."""
    mesh = _mesh()
    if not runtime.available():
        pytest.skip(f"pk_jax extension unavailable: {runtime.extension_error()}")
    ids = jnp.zeros((64, 2), jnp.int32)

    def body(x):
        rows, lay = pk_jax.moe_dispatch(x, ids, "ep", num_experts=4, mechanism="ld_st")
        return pk_jax.moe_combine(rows, jnp.ones((64, 2)), lay)
    n = mesh.shape["ep"]
    x = jax.device_put(jnp.ones((64 * n, 32)), NamedSharding(mesh, P("ep")))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                     check_vma=False)).lower(x).compile().as_text()
    assert "pk_moe_exchange" in text


def _child_env() -> dict:
    """A child process's environment: its XLA takes GPU memory as it needs it
    (this process holds most of the GPU; a child preallocating the rest left
    nothing for NCCL and pk's workspaces: out of memory on an H100)."""
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def test_example_trains_on_gpu():
    _mesh()
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "moe.py"), "--steps", "12",
                           "--ep", "1"], env=_child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step time: pk" in proc.stdout, proc.stdout


def test_benchmark_smoke():
    _mesh()
    proc = subprocess.run([sys.executable, "moe.py", "--smoke"], cwd=ROOT / "benchmarks",
                          env=_child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moe_layer_fwd_bwd" in proc.stdout, proc.stdout
