"""Issue 17, "a timeout is a safe abort", on two GPUs (one process).

* A peer that arrives after the timeout (made late by work only it runs,
  before the op): a zero-copy gather (ld_st push / pull) revokes its offer,
  so the late peer copies nothing into (or out of) buffers XLA has taken
  back; both record an error and both outputs are poison. LL and the copy
  engine stage in the workspace: the late peer's own result is right.
* Two programs whose gathers share a channel but run in different orders
  (a shape on one GPU, another on the other): an error on both, no byte
  copied with the wrong layout, outputs poison.
* A staged push whose credit wait timed out (the peer was still reading
  the previous call's slot): the peer's call that read it is poisoned and
  says so.
* After any failed wait, every output of that call on that device is
  poison: NaN in float outputs (also the GEMMs' and ring attention's), all
  bits set in integer ones; the block backward, a local op, returns NaN on
  a device that holds an error.
* Under command buffers (a replayed step runs no handler) a call on a
  device that holds an error returns poison or raises, never a plausible
  value (a subprocess whose XLA graphs every custom call).

Error messages come from the runtime's description of the error record
(csrc/runtime: describe()); the words matched here are the ones the
records' codes stand for: "revoked" (kErrRevoked), "layout" (kErrLayout),
"overwr" (kErrClobbered).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime
from pk_jax.ops.ring_attention.primitive import KERNEL_MECHANISMS as RING_MECHANISMS
from conftest import gpu_mesh

pytestmark = pytest.mark.gpu

TIMEOUT_S = 0.2
# Work that only the late rank runs before the op: about a second of bf16
# matmuls on an H200 (several timeouts), longer on a shared GPU.
SLOW_ITERS = 400
SLOW_N = 8192


def _late(x, rank: int = 1):
    """x, after SLOW_ITERS matmuls on mesh position `rank` only (the value
    is unchanged; the op that consumes it starts late there)."""
    def slow(a):
        eye = jnp.eye(SLOW_N, dtype=jnp.bfloat16)
        c = lax.fori_loop(0, SLOW_ITERS, lambda i, c: jnp.dot(c, eye), eye)
        return a + (c[0, 0].astype(jnp.float32) * 0.0).astype(a.dtype)
    return lax.cond(lax.axis_index("x") == rank, slow, lambda a: a, x)


def _shards(arr, mesh) -> list[np.ndarray]:
    """arr's shard on each mesh position, in mesh order."""
    by_device = {s.device: np.asarray(s.data) for s in arr.addressable_shards}
    return [by_device[d] for d in mesh.devices.flat]


def _is_poison(a: np.ndarray) -> bool:
    """Every element NaN (floats) or all bits set (integers)."""
    if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
        return bool(np.all(np.isnan(np.asarray(a, np.float32))))
    return bool(np.all(a.view(np.uint8) == 0xFF))


def _gather(mesh, mechanism, late: bool = False):
    def body(a):
        if late:
            a = _late(a)
        return pk_jax.all_gather(a, "x", mechanism=mechanism, tiled=True)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def _ints(mesh, m: int, seed: int = 0):
    a = np.random.default_rng(seed).integers(0, 1 << 30, 2 * m, dtype=np.int32)
    return jax.device_put(a, NamedSharding(mesh, P("x"))), a


def _recovers(mesh, mechanism):
    """After check_errors() the same op is right again."""
    x, host = _ints(mesh, 1024, seed=7)
    out = _shards(_gather(mesh, mechanism)(x), mesh)
    for o in out:
        np.testing.assert_array_equal(o, host)
    pk_jax.check_errors()


def _expect_errors(match: str | None = None):
    with pytest.raises(pk_jax.PkJaxTimeoutError, match=match):
        pk_jax.check_errors()


# ---- a peer that arrives after the timeout -------------------------------------
@pytest.mark.parametrize("mechanism", ["ld_st_push", "ld_st_pull"])
def test_late_peer_zero_copy_is_revoked(mechanism):
    """Rank 0 gives up and revokes its offer before rank 1 arrives: rank 1
    must not touch rank 0's buffers (they are XLA's again), both ranks
    record an error (rank 1: the offer was revoked), both outputs are
    poison (int32: all bits set)."""
    mesh = gpu_mesh(2)
    x, _ = _ints(mesh, 4096)
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        out = _shards(_gather(mesh, mechanism, late=True)(x), mesh)
    assert _is_poison(out[0]) and _is_poison(out[1])
    _expect_errors(r"(?s)rank 0.*rank 1|rank 1.*rank 0")
    _recovers(mesh, mechanism)


def test_late_peer_revocation_is_reported():
    """The late rank's record says it found the offer revoked."""
    mesh = gpu_mesh(2)
    x, _ = _ints(mesh, 4096)
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        jax.block_until_ready(_gather(mesh, "ld_st_push", late=True)(x))
    _expect_errors("revoked")
    _recovers(mesh, "ld_st_push")


@pytest.mark.parametrize("mechanism", ["ld_st_ll", "copy_engine"])
def test_late_peer_staged(mechanism):
    """LL lines and copy-engine slots live in the workspace: the waiting rank
    gives up (poison), the late rank reads data that did arrive (right)."""
    mesh = gpu_mesh(2)
    x, host = _ints(mesh, 1024)
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        out = _shards(_gather(mesh, mechanism, late=True)(x), mesh)
    assert _is_poison(out[0])
    np.testing.assert_array_equal(out[1], host)
    _expect_errors(r"rank 0\).*peer rank 1")
    _recovers(mesh, mechanism)


def test_late_peer_clobbered_slot_is_detected():
    """Two copy-engine gathers; rank 1 starts the first one late. Rank 0
    times out on the first, and its second call's credit wait times out too,
    so its push overwrites the slot rank 1's first call is about to read:
    rank 1's first call must find the mark, record it and return poison."""
    mesh = gpu_mesh(2)
    x, _ = _ints(mesh, 1024)

    def body(a):
        g1 = pk_jax.all_gather(_late(a), "x", mechanism="copy_engine", tiled=True)
        g1, a = lax.optimization_barrier((g1, a))
        g2 = pk_jax.all_gather(a + 1, "x", mechanism="copy_engine", tiled=True)
        return g1, g2

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")),
                              check_vma=False))
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        g1, g2 = f(x)
    g1, g2 = _shards(g1, mesh), _shards(g2, mesh)
    assert _is_poison(g1[0]) and _is_poison(g2[0]) and _is_poison(g1[1])
    _expect_errors("overwr")
    _recovers(mesh, "copy_engine")


# ---- two programs that share a channel, in different orders -----------------------
@pytest.mark.parametrize("mechanism", ["ld_st_push", "ld_st_pull", "ld_st_ll"])
def test_mispaired_gathers_never_copy_with_the_wrong_layout(mechanism):
    """Rank 0 gathers a [1024] then b [2048]; rank 1 gathers b then a. The
    gathers share the channel (one group, one mechanism, nothing staged), so
    each call pairs shapes that differ: with push, rank 1 would write its
    2048 words per rank into rank 0's output of 1024. Every call records a
    layout error instead and its output is poison."""
    mesh = gpu_mesh(2)
    a, _ = _ints(mesh, 1024, seed=1)
    b, _ = _ints(mesh, 2048, seed=2)
    g = lambda v: pk_jax.all_gather(v, "x", mechanism=mechanism, tiled=True)

    def a_first(a, b):
        ga = g(a)
        ga, b = lax.optimization_barrier((ga, b))
        return ga, g(b)

    def b_first(a, b):
        gb = g(b)
        gb, a = lax.optimization_barrier((gb, a))
        return g(a), gb

    f = jax.jit(jax.shard_map(
        lambda a, b: lax.cond(lax.axis_index("x") == 0, a_first, b_first, a, b),
        mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        ga, gb = f(a, b)
    for out in (*_shards(ga, mesh), *_shards(gb, mesh)):
        assert _is_poison(out)
    _expect_errors("layout")
    _recovers(mesh, mechanism)


# ---- every output of a failed call is poison ---------------------------------------
def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def test_all_gather_matmul_timeout_poisons_its_outputs():
    mesh = gpu_mesh(2)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    f = lambda: jax.jit(jax.shard_map(
        lambda x, w: pk_jax.all_gather_matmul(x, w, "x", mechanism="chunked",
                                              return_gathered=True),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=(P(None, "x"), P("x")),
        check_vma=False))
    x = _put(mesh, jnp.ones((512, 256), jnp.bfloat16), P("x"))
    w = _put(mesh, jnp.ones((256, 512), jnp.bfloat16), P(None, "x"))
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        with runtime.testing_skip_post(1):
            out, gathered = f()(x, w)
    out, gathered = _shards(out, mesh), _shards(gathered, mesh)
    assert _is_poison(out[0]) and _is_poison(gathered[0])
    assert np.all(np.asarray(out[1], np.float32) == 256.0)  # rank 1 got rank 0's rows
    _expect_errors(r"all_gather_matmul.*peer rank 1")


def test_matmul_reduce_scatter_timeout_poisons_its_output():
    mesh = gpu_mesh(2)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    f = jax.jit(jax.shard_map(
        lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "x", mechanism="chunked"),
        mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x")))
    x = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P(None, "x"))
    w = _put(mesh, jnp.ones((256, 256), jnp.bfloat16), P("x", None))
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        with runtime.testing_skip_post(1):
            out = _shards(f(x, w), mesh)
    assert _is_poison(out[0])
    _expect_errors(r"matmul_reduce_scatter.*peer rank 1")


@pytest.mark.parametrize("mechanism", list(RING_MECHANISMS))
def test_ring_attention_timeout_poisons_out_and_lse(mechanism):
    """Rank 0 waits for rank 1's K/V in vain: all of rank 0's output and
    log-sum-exp is NaN (not only the tiles whose waits failed); rank 1,
    whose waits succeeded, is finite."""
    mesh = gpu_mesh(2)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    seq = P(None, "x")
    f = jax.jit(jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "x", causal=False, layout="contiguous",
                                              mechanism=mechanism, return_lse=True),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, P(None, None, "x"))))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (_put(mesh, jax.random.normal(kk, (1, 2 * 1024, 8, 128), jnp.bfloat16), seq)
               for kk in keys)
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        with runtime.testing_skip_post(1):
            out, lse = f(q, k, v)
    out, lse = _shards(out, mesh), _shards(lse, mesh)
    assert _is_poison(out[0]) and _is_poison(lse[0])
    assert np.all(np.isfinite(np.asarray(out[1], np.float32)))
    _expect_errors(r"ring_attention.*peer rank 1")


def test_block_backward_on_a_failed_device_is_nan():
    """The block backward waits on nothing, but a device that holds an error
    (here: an all_gather timed out on it and check_errors() has not run)
    makes it return NaN too, so the step it belongs to cannot look right."""
    mesh = gpu_mesh(2)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    from pk_jax.ops.ring_attention.attention_bwd_primitive import block_bwd
    from pk_jax.ops.ring_attention.primitive import RingConfig
    x, _ = _ints(mesh, 1024)
    with pk_jax.configured(timeout_s=TIMEOUT_S):
        with runtime.testing_skip_post(1):
            jax.block_until_ready(_gather(mesh, "ld_st_push")(x))
    try:
        cfg = RingConfig(names=(), n=1, causal=False, scale=128 ** -0.5, layout="contiguous",
                         mechanism="copy_engine", block_grads="kernel")
        dev0 = mesh.devices.flat[0]
        keys = jax.random.split(jax.random.key(1), 4)
        put = lambda a: jax.device_put(a, dev0)
        q, do = (put(jax.random.normal(kk, (1, 256, 4, 128), jnp.bfloat16)) for kk in keys[:2])
        k, v = (put(x) for x in jax.random.normal(keys[2], (2, 1, 256, 4, 128), jnp.bfloat16))
        lse = put(jnp.full((1, 4, 256), 8.0, jnp.float32))
        delta = put(jax.random.normal(keys[3], (1, 4, 256), jnp.float32))
        for grad_dtype in (jnp.float32, jnp.bfloat16):
            dq, dk, dv = jax.jit(block_bwd, static_argnums=(8, 9))(
                q, do, lse, delta, k, v, jnp.int32(0), jnp.int32(0), cfg, grad_dtype)
            assert all(_is_poison(np.asarray(x)) for x in (dq, dk, dv)), grad_dtype
    finally:
        _expect_errors()


# ---- command buffers: a replayed step runs no handler ------------------------------
_REPLAY = textwrap.dedent("""
    import jax, numpy as np, pytest
    from jax.sharding import NamedSharding, PartitionSpec as P
    import pk_jax
    from pk_jax import runtime
    from conftest import gpu_mesh
    from helpers.gpu_util import captured

    mesh = gpu_mesh(2)
    f = lambda: jax.jit(jax.shard_map(
        lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_push", tiled=True),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    host = np.arange(2 * 4096, dtype=np.int32)
    x = jax.device_put(host, NamedSharding(mesh, P("x")))
    good = f()
    # The premise: XLA put the custom call into a command buffer, so a replay
    # runs the recorded kernel without calling the handler.
    targets = captured(good.lower(x)).targets
    assert "pk_all_gather" in targets, f"not in a command buffer: {sorted(targets)}"
    for _ in range(3):  # recorded, then replayed
        np.testing.assert_array_equal(np.asarray(good(x)), np.concatenate([host, host]))
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            jax.block_until_ready(f()(x))   # device 0 now holds an error
    poison_checked = 0
    for _ in range(5):
        try:
            out = good(x)
            shard0 = [np.asarray(s.data) for s in out.addressable_shards
                      if s.device == mesh.devices.flat[0]][0]
            del out  # its buffer goes back: the next call reuses it (a replay, no update)
        except Exception as e:   # the handler ran and refused: fine
            assert "timed out" in str(e) or "pk_jax" in str(e), e
            continue
        assert np.all(shard0 == -1), "a call on a failed device returned data"
        poison_checked += 1
    assert poison_checked, "every call raised: no replay reached the poison check"
    with pytest.raises(pk_jax.PkJaxTimeoutError):
        pk_jax.check_errors()
    np.testing.assert_array_equal(np.asarray(good(x)), np.concatenate([host, host]))
    print("SUBPROCESS_OK")
""")


def test_replayed_call_on_a_failed_device_is_poison():
    gpu_mesh(2)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process holds most of each GPU
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _REPLAY], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tests)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "SUBPROCESS_OK" in proc.stdout, report
