"""The block backward kernel (pk_attention_block_bwd) on a GPU against
`reference.attention_block_grads` (what the primitive lowers to off CUDA) on
the float32-upcast inputs, with tolerances set by the same computation in the
kernel's precision (bf16/fp16 operands, P and dS rounded to the input type,
fp32 accumulation: what any flash-attention backward can reach). Masks by
global positions: non-causal, causal contiguous with the K/V block before,
equal to and after the query block, zigzag on rings of 2 and 4 for every
(query rank, K/V rank) pair; GQA groups 1, 4, 8 and MQA; head dims 64 and 128;
bf16 and fp16; B > 1; S != T; more (batch, K/V head) pairs than the causal
launch order's group of 16. Plus jax.grad through pk_jax.ring_attention
(mechanism copy_engine; the fused ring backward on 2 GPUs) on 1 and 2 GPUs
against jax.grad of jax.nn.dot_product_attention in float32, and the fused
backward against the XLA-collective ring. Skipped with a reason without GPUs
or without the kernel.

Inputs are fresh every run (a seed drawn from numpy's default_rng, named in
failure messages; `PK_JAX_TEST_SEED=<seed>` reruns with it); freed device
memory is filled with 0xFF (NaN in fp32) before each call, so an output
element the kernel never writes shows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import reference, runtime, tuning
from pk_jax.ops.ring_attention.attention_bwd_primitive import block_bwd, kernel_problem
from pk_jax.ops.ring_attention.primitive import RingConfig
from conftest import gpu_mesh
from helpers.gpu_util import poison_allocator
from helpers.seeds import fresh_seed

pytestmark = pytest.mark.gpu


def _need_kernel():
    mesh = gpu_mesh(1)
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels (pip install nvidia-cutlass, "
                    "then reinstall pk_jax)")
    return mesh


def _cfg(n, causal, layout, d):
    return RingConfig(names=(), n=n, causal=causal, scale=float(d) ** -0.5, layout=layout,
                      mechanism="copy_engine", block_grads="kernel")


def _inputs(seed, b, s, t, hq, hkv, d, dtype):
    """q, dout [B, S, Hq, D], k, v [B, T, Hkv, D] of `dtype`, and delta'
    [B, Hq, S] fp32, all random (never zeros)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    draw = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    q, do = draw(keys[0], (b, s, hq, d)), draw(keys[1], (b, s, hq, d))
    k, v = draw(keys[2], (b, t, hkv, d)), draw(keys[3], (b, t, hkv, d))
    delta = jax.random.normal(keys[4], (b, hq, s), jnp.float32)
    extra = jax.random.uniform(keys[5], (b, hq, s), jnp.float32, 0.0, 2.0)
    return q, do, k, v, delta, extra


def _visible(cfg, s, t, q_rank, k_rank):
    q_pos = reference.positions(jnp.int32(q_rank), cfg.n, s, cfg.layout)
    k_pos = reference.positions(jnp.int32(k_rank), cfg.n, t, cfg.layout)
    return q_pos[:, None] >= k_pos[None, :] if cfg.causal else jnp.ones((s, t), bool)


@functools.partial(jax.jit, static_argnums=(3,))
def _lse(q, k, visible, scale, extra):
    """A log-sum-exp as the forward leaves it: this block's (fp32) plus the
    mass of other blocks (`extra` >= 0), so every p = exp(s - lse) <= 1."""
    g = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    sc = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.float32), kk,
                    precision=lax.Precision.HIGHEST) * scale
    sc = jnp.where(visible, sc, -jnp.inf)
    own = jax.nn.logsumexp(sc, axis=-1)
    return jnp.where(jnp.isfinite(own), jnp.logaddexp(own, extra), extra)


@functools.partial(jax.jit, static_argnums=(8,))
def _exact(q, do, lse, delta, k, v, q_rank, k_rank, cfg):
    """reference.attention_block_grads (what the primitive lowers to off CUDA)
    on the float32 inputs, full-precision matmuls (no TF32)."""
    with jax.default_matmul_precision("highest"):
        f32 = lambda x: x.astype(jnp.float32)
        return reference.attention_block_grads(
            f32(q), f32(do), lse, delta, f32(k), f32(v),
            reference.positions(q_rank, cfg.n, q.shape[1], cfg.layout),
            reference.positions(k_rank, cfg.n, k.shape[1], cfg.layout),
            causal=cfg.causal, scale=cfg.scale)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _same_precision(q, do, lse, delta, k, v, visible, cfg, dtype):
    """(dq, dk, dv) fp32 of one block pair with each matmul's operands in
    `dtype` (P and dS rounded as a flash-attention backward does) and fp32
    accumulation: the error any such kernel makes."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    f32 = jnp.float32
    c = lambda x: x.astype(dtype)
    mm = functools.partial(jnp.einsum, preferred_element_type=f32,
                           precision=lax.Precision.HIGHEST)
    q5, do5 = (c(x).reshape(b, s, hkv, g, d) for x in (q, do))
    kc, vc = c(k), c(v)
    sc = mm("bskgd,btkd->bkgst", q5, kc) * cfg.scale
    p = jnp.where(visible, jnp.exp(sc - lse.reshape(b, hkv, g, s)[..., None]), 0.0)
    dv = mm("bkgst,bskgd->btkd", c(p), do5)
    dp = mm("bskgd,btkd->bkgst", do5, vc)
    ds = p * (dp - delta.reshape(b, hkv, g, s)[..., None]) * cfg.scale
    dq = mm("bkgst,btkd->bskgd", c(ds), kc).reshape(b, s, hq, d)
    dk = mm("bkgst,bskgd->btkd", c(ds), q5)
    return dq, dk, dv


@functools.partial(jax.jit, static_argnums=(8, 9))
def _kernel(q, do, lse, delta, k, v, q_rank, k_rank, cfg, grad_dtype=jnp.float32):
    """(dq, dk, dv) of the block kernel; dk and dv as fp32 shares or in the
    inputs' dtype (`grad_dtype`)."""
    return block_bwd(q, do, lse, delta, k, v, q_rank, k_rank, cfg, grad_dtype)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb > 0 else float(np.linalg.norm(a))


def _check_pair(mesh, seed, cfg, dims, dtype, q_rank, k_rank, data=None):
    b, s, t, hq, hkv, d = dims
    q, do, k, v, delta, extra = data or _inputs(seed, *dims, dtype)
    visible = _visible(cfg, s, t, q_rank, k_rank)
    lse = _lse(q, k, visible, cfg.scale, extra)
    what = (f"n={cfg.n} {cfg.layout} causal={cfg.causal} q_rank={q_rank} k_rank={k_rank} "
            f"dims={dims} {jnp.dtype(dtype).name} (seed {seed})")
    assert kernel_problem(q, k, cfg.layout) is None, what
    poison_allocator(mesh, 4 * (q.size + 2 * k.size) + 4096)
    got = _kernel(q, do, lse, delta, k, v, jnp.int32(q_rank), jnp.int32(k_rank), cfg)
    got = [np.asarray(x) for x in got]
    ranks = jnp.int32(q_rank), jnp.int32(k_rank)
    exact = [np.asarray(x) for x in _exact(q, do, lse, delta, k, v, *ranks, cfg)]
    same = _same_precision(q, do, lse, delta, k, v, visible, cfg, dtype)
    for name, g, e, h in zip(("dq", "dk", "dv"), got, exact, same):
        assert g.dtype == np.float32 and g.shape == e.shape, f"{name} {g.shape} {g.dtype}: {what}"
        assert np.all(np.isfinite(g)), f"{name}: non-finite (unwritten?) elements: {what}"
        # Rows the mask hides wholly are exact zeros: so must the kernel's be.
        zero = e == 0
        assert np.all(g[zero] == 0), f"{name}: nonzero where the mask hides everything: {what}"
        err, base = _rel(g, e), _rel(h, e)
        assert err <= 1.5 * base + 2e-3, (
            f"{name}: rel err {err:.3g} against fp32, same-precision {base:.3g}: {what}")
    if cfg.n == 1:
        # A ring of one writes dk, dv in the inputs' dtype: the same (fp32,
        # deterministic) sums, rounded once at the store.
        poison_allocator(mesh, 4 * (q.size + 2 * k.size) + 4096)
        narrow = _kernel(q, do, lse, delta, k, v, *ranks, cfg, jnp.dtype(dtype))
        for name, g, f in zip(("dk", "dv"), narrow[1:], got[1:]):
            g = np.asarray(g)
            assert g.dtype == jnp.dtype(dtype), f"{name} {g.dtype}: {what}"
            np.testing.assert_array_equal(g, f.astype(dtype), err_msg=f"{name} narrow: {what}")
    pk_jax.check_errors()


DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_non_causal(dtype, d, group):
    mesh = _need_kernel()
    dims = (2, 256, 384, 8, 8 // group, d)  # S != T
    _check_pair(mesh, fresh_seed(), _cfg(1, False, "contiguous", d), dims, dtype, 0, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_causal_contiguous_before_equal_after(dtype, d):
    """Rank 2 of 4: the K/V block of rank 1 is wholly visible, rank 2's is the
    diagonal, rank 3's wholly hidden (every tile skipped: all zeros)."""
    mesh = _need_kernel()
    seed, dims = fresh_seed(), (2, 256, 256, 8, 2, d)
    data = _inputs(seed, *dims, dtype)
    for k_rank in (1, 2, 3):
        _check_pair(mesh, seed, _cfg(4, True, "contiguous", d), dims, dtype, 2, k_rank, data)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_zigzag_every_rank_pair(n, dtype, d):
    mesh = _need_kernel()
    seed, dims = fresh_seed(), (2, 512, 512, 8, 2, d)
    data = _inputs(seed, *dims, dtype)
    for q_rank in range(n):
        for k_rank in range(n):
            _check_pair(mesh, seed, _cfg(n, True, "zigzag", d), dims, dtype, q_rank, k_rank, data)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_groups_and_mqa(hq, hkv, d):
    mesh = _need_kernel()
    seed, dims = fresh_seed(), (2, 256, 256, hq, hkv, d)
    data = _inputs(seed, *dims, jnp.bfloat16)
    for q_rank, k_rank in ((0, 0), (1, 0), (1, 1)):
        _check_pair(mesh, seed, _cfg(2, True, "zigzag", d), dims, jnp.bfloat16, q_rank, k_rank,
                    data)


@pytest.mark.parametrize("layout,n", [("contiguous", 1), ("zigzag", 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_causal_launch_groups(layout, n, d):
    """Under a causal mask the kernel launches K/V tile by K/V tile within
    groups of 16 (batch, K/V head) pairs (KvTileScheduler): 3 x 7 = 21 pairs
    make one whole group and one of 5, every pair's tiles computed once."""
    mesh = _need_kernel()
    seed, dims = fresh_seed(), (3, 512, 512, 14, 7, d)
    data = _inputs(seed, *dims, jnp.bfloat16)
    for q_rank, k_rank in ((0, 0),) if n == 1 else ((0, 0), (1, 0), (1, 1)):
        _check_pair(mesh, seed, _cfg(n, True, layout, d), dims, jnp.bfloat16, q_rank, k_rank,
                    data)


@pytest.mark.parametrize("causal,layout,n,b,s,t,d", [
    (False, "contiguous", 1, 3, 128, 128, 64),
    (False, "contiguous", 1, 1, 64, 1024, 128),
    (True, "contiguous", 2, 2, 512, 256, 128),   # S != T, causal by global positions
    (True, "contiguous", 2, 1, 1024, 1024, 64),
    (True, "zigzag", 2, 1, 2048, 2048, 128),
])
def test_sizes(causal, layout, n, b, s, t, d):
    mesh = _need_kernel()
    seed, dims = fresh_seed(), (b, s, t, 4, 2, d)
    data = _inputs(seed, *dims, jnp.bfloat16)
    for q_rank in range(n):
        for k_rank in range(n):
            _check_pair(mesh, seed, _cfg(n, causal, layout, d), dims, jnp.bfloat16, q_rank,
                        k_rank, data)


# ---- end to end: gradients of the ring ---------------------------------------------
SEQ = P(None, "sp")


def _check_ring_grads(got, exact, same, dtype, what: str) -> None:
    """(dq, dk, dv) of jax.grad through ring attention: `dtype`, the shapes of
    the float32 reference `exact`, finite, and within twice the error of the
    same computation in XLA at the inputs' precision (`same`) plus 5e-3."""
    for name, g, e, h in zip(("dq", "dk", "dv"), got, exact, same):
        assert g.shape == e.shape and g.dtype == dtype, f"{name}: {g.shape} {g.dtype}: {what}"
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{name}: non-finite: {what}"
        err, base = _rel(g, e), _rel(h, e)
        assert err <= 2 * base + 5e-3, (f"{name}: rel err {err:.3g} against fp32, "
                                        f"same-precision XLA {base:.3g}: {what}")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (True, "contiguous"),
                                           (False, "contiguous")])
def test_ring_attention_grads(n, causal, layout):
    """jax.grad through pk_jax.ring_attention (copy_engine: fused forward;
    backward: the block kernel on one GPU, the fused ring backward on two)
    against jax.grad of jax.nn.dot_product_attention on the whole sequence
    in float32."""
    _need_kernel()
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    b, s, hq, hkv, d, dtype = 2, n * 512, 8, 2, 128, jnp.bfloat16
    keys = jax.random.split(jax.random.key(seed), 4)
    draw = lambda kk, h: jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    q, k, v = draw(keys[0], hq), draw(keys[1], hkv), draw(keys[2], hkv)
    w = jax.random.normal(keys[3], (b, s, hq, d), jnp.float32)  # the output's cotangent

    ring = jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal, layout=layout,
                                              mechanism="copy_engine"),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    shard = (lambda x: pk_jax.zigzag_shard(x, n)) if layout == "zigzag" else (lambda x: x)
    sharding = NamedSharding(mesh, SEQ)

    def ring_loss(q, k, v):
        return jnp.sum(ring(q, k, v).astype(jnp.float32) * shard(w))

    def ref_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        return jnp.sum(out.astype(jnp.float32) * w)

    grad = jax.jit(jax.grad(ring_loss, (0, 1, 2)))
    args = [jax.device_put(shard(x), sharding) for x in (q, k, v)]
    kernel = "pk_ring_attention_bwd" if n > 1 else "pk_attention_block_bwd"
    assert kernel in grad.lower(*args).as_text(), f"no {kernel} in the program"
    poison_allocator(mesh, 4 * q.size + 4096)
    got = [jax.device_put(pk_jax.zigzag_unshard(g, n) if layout == "zigzag" else g,
                          mesh.devices.flat[0]) for g in grad(*args)]
    pk_jax.check_errors()
    ref = jax.jit(jax.grad(ref_loss, (0, 1, 2)))
    with jax.default_matmul_precision("highest"):
        exact = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
    same = ref(q, k, v)
    _check_ring_grads(got, exact, same, dtype, f"n={n} causal={causal} {layout} (seed {seed})")


@pytest.mark.parametrize("n", [1, 2])
def test_grads_through_layers_in_scan(n):
    """jax.grad through 3 layers of ring attention in one lax.scan (the
    forward kernel and the backward ring's block kernels, each called once per
    layer inside the loop) against jax.grad of the same stack of
    jax.nn.dot_product_attention in float32."""
    _need_kernel()
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    layers, b, s, hq, hkv, d, dtype = 3, 1, n * 512, 8, 2, 64, jnp.bfloat16
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
            for kk in keys[1:3])
    w = jax.random.normal(keys[3], (b, s, hq, d), jnp.float32)

    def stack(attend, q, k, v):
        step = lambda c, _: ((attend(c, k, v) * 4.0).astype(c.dtype), None)
        return lax.scan(step, q, None, length=layers)[0]

    ring = jax.shard_map(
        lambda q, k, v: stack(lambda c, k, v: pk_jax.ring_attention(
            c, k, v, "sp", causal=True, layout="zigzag", mechanism="copy_engine"), q, k, v),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    plain = functools.partial(stack, lambda c, k, v: jax.nn.dot_product_attention(
        c, k, v, is_causal=True))
    wz = pk_jax.zigzag_shard(w, n)
    grad = jax.jit(jax.grad(lambda *x: jnp.sum(ring(*x).astype(jnp.float32) * wz), (0, 1, 2)))
    sharding = NamedSharding(mesh, SEQ)
    args = [jax.device_put(pk_jax.zigzag_shard(x, n), sharding) for x in (q, k, v)]
    kernel = "pk_ring_attention_bwd" if n > 1 else "pk_attention_block_bwd"
    assert kernel in grad.lower(*args).as_text(), f"no {kernel} in the program"
    got = [jax.device_put(pk_jax.zigzag_unshard(g, n), mesh.devices.flat[0]) for g in grad(*args)]
    pk_jax.check_errors()
    ref = jax.jit(jax.grad(lambda *x: jnp.sum(plain(*x).astype(jnp.float32) * w), (0, 1, 2)))
    with jax.default_matmul_precision("highest"):
        exact = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
    same = ref(q, k, v)
    _check_ring_grads(got, exact, same, dtype, f"n={n}, {layers} layers in scan (seed {seed})")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_fused_backward_matches_the_xla_transport(monkeypatch, layout):
    """The fused backward (pk's transport) against the same ring with XLA's
    collective-permutes between block kernels, on 2 GPUs: dK and dV bitwise
    equal (the same block kernel outputs, the same fp32 adds in the same
    ring order, one cast), and equal again on a second run; dq close (its
    reduce-adds land in arrival order either way, and the fused call
    accumulates every step into one buffer)."""
    _need_kernel()
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    b, s, hq, hkv, d, dtype = 2, 2 * 1024, 8, 2, 128, jnp.bfloat16
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
            for kk in keys[1:3])
    w = jax.random.normal(keys[3], (b, s, hq, d), jnp.float32)
    sharding = NamedSharding(mesh, SEQ)
    args = [jax.device_put(x, sharding) for x in (q, k, v, w)]

    def grads(transport):
        monkeypatch.setattr(tuning, "RING_ATTENTION_BWD_TRANSPORT", transport)
        ring = jax.shard_map(
            lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True, layout=layout,
                                                  mechanism="copy_engine"),
            mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        loss = lambda q, k, v, w: jnp.sum(ring(q, k, v).astype(jnp.float32) * w)
        f = jax.jit(jax.grad(loss, (0, 1, 2)))
        text = f.lower(*args).as_text()
        assert ("pk_ring_attention_bwd" in text) == (transport == "pk"), transport
        poison_allocator(mesh, 4 * q.size + 4096)
        return [np.asarray(g, np.float32) for g in f(*args)]

    fused, again, xla = grads("pk"), grads("pk"), grads("xla")
    pk_jax.check_errors()
    what = f"{layout} (seed {seed})"
    for name, a, a2, x in zip(("dq", "dk", "dv"), fused, again, xla):
        assert np.all(np.isfinite(a)), f"{name}: non-finite: {what}"
        if name == "dq":
            assert _rel(a, x) < 1e-2, f"dq: fused vs xla rel {_rel(a, x):.3g}: {what}"
        else:
            np.testing.assert_array_equal(a, x, err_msg=f"{name}: fused != xla transport: {what}")
            np.testing.assert_array_equal(a, a2, err_msg=f"{name} differs between runs: {what}")


def test_deterministic_grads_repeat_bitwise():
    """deterministic=True on 2 GPUs: two runs give bitwise-identical
    gradients (einsum block gradients in the ring's fixed order), close to
    the block kernel's."""
    _need_kernel()
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    b, s, hq, hkv, d, dtype = 1, 2 * 512, 8, 2, 128, jnp.bfloat16
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype) for kk in keys[1:])
    sharding = NamedSharding(mesh, SEQ)
    args = [jax.device_put(x, sharding) for x in (q, k, v)]

    def grads(deterministic):
        ring = jax.shard_map(
            lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True, layout="zigzag",
                                                  mechanism="copy_engine",
                                                  deterministic=deterministic),
            mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        loss = lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32) ** 2)
        return [np.asarray(g, np.float32) for g in jax.jit(jax.grad(loss, (0, 1, 2)))(*args)]

    first, second, kernel = grads(True), grads(True), grads(False)
    pk_jax.check_errors()
    for name, a, b_, c in zip(("dq", "dk", "dv"), first, second, kernel):
        np.testing.assert_array_equal(a, b_, err_msg=f"{name} differs between runs (seed {seed})")
        assert _rel(c, a) < 2e-2, f"{name}: kernel vs deterministic rel {_rel(c, a):.3g} (seed {seed})"


def test_training_tracks_plain_attention():
    """A one-layer attention model (bf16 attention, fp32 projections) trained
    for 30 SGD steps on 2 GPUs with ring attention (fused forward, block
    backward kernel, causal zigzag) follows the loss curve of the same model
    with jax.nn.dot_product_attention on the whole sequence, step for step.
    The target is a teacher of the same shape, so the loss can fall."""
    _need_kernel()
    n, b, s, h, d = 2, 2, 1024, 4, 64
    dm, bf16, lr = h * d, jnp.bfloat16, 8.0
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (b, s, dm), jnp.float32)

    def init(key):
        ks = jax.random.split(key, 4)
        return {w: jax.random.normal(kk, (dm, dm), jnp.float32) * dm ** -0.5
                for w, kk in zip(("wq", "wk", "wv", "wo"), ks)}

    def model(p, x, attend):
        q, k, v = ((x @ p[w]).astype(bf16).reshape(b, -1, h, d) for w in ("wq", "wk", "wv"))
        return attend(q, k, v).astype(jnp.float32).reshape(b, -1, dm) @ p["wo"]

    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    ring = jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True, layout="zigzag",
                                              mechanism="copy_engine"),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    teacher, student = init(keys[1]), init(keys[2])
    y = jax.jit(model, static_argnums=2)(teacher, x, plain)
    sharding = NamedSharding(mesh, SEQ)
    xz, yz = (jax.device_put(pk_jax.zigzag_shard(a, n), sharding) for a in (x, y))

    def train(attend, x, y):
        loss = lambda p: jnp.mean((model(p, x, attend) - y) ** 2)
        step = jax.jit(lambda p: (loss(p), jax.tree.map(lambda a, g: a - lr * g, p,
                                                        jax.grad(loss)(p))))
        p, losses = student, []
        for _ in range(30):
            value, p = step(p)
            losses.append(float(value))
        return np.array(losses)

    ours = train(ring, xz, yz)
    pk_jax.check_errors()
    ref = train(plain, x, y)
    assert np.all(np.isfinite(ours)), f"non-finite loss {ours} (seed {seed})"
    assert ours[-1] < 0.7 * ours[0], f"ring attention did not learn: {ours} (seed {seed})"
    worst = float(np.max(np.abs(ours - ref) / ref))
    assert worst < 2e-2, (f"loss curves differ by {worst:.3g} (relative): ring {ours}, "
                          f"plain {ref} (seed {seed})")


# ---- 64-bit offsets: the largest shapes one H200 holds -----------------------------
# q, dout [2, 131072, 128, 128] bf16 (8 GiB each), dq fp32 (16 GiB): their
# batch stride S * Hq * D is 2^31 elements, so batch entry 1 starts where a
# 32-bit stride wraps (the kernel's strides were `int` before). hkv = 128 puts
# K/V and dK/dV there too (kv 16 GiB, dkv fp32 32 GiB: about 86 GB in all);
# hkv = 16 needs about 45 GB. Checked on sampled rows (dq) and sampled K/V
# rows (dk, dv) against fp32 sums over the whole other side: the dense
# reference would need S * T scores per head.
BIG_B, BIG_S, BIG_HQ, BIG_D = 2, 131072, 128, 128


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draw(shape, key, dtype):
    return jax.random.normal(key, shape, dtype)


def _big_inputs(seed, hkv):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = _draw((BIG_B, BIG_S, BIG_HQ, BIG_D), keys[0], jnp.bfloat16)
    do = _draw((BIG_B, BIG_S, BIG_HQ, BIG_D), keys[1], jnp.bfloat16)
    kv = tuple(_draw((BIG_B, BIG_S, hkv, BIG_D), key, jnp.bfloat16) for key in keys[2:6:3])
    delta = _draw((BIG_B, BIG_HQ, BIG_S), keys[3], jnp.float32)
    # A log-sum-exp near the true one of random scores (log T + 1/2), plus
    # the mass of other blocks: p = exp(s - lse) stays at softmax scale.
    extra = jax.random.uniform(keys[4], (BIG_B, BIG_HQ, BIG_S), jnp.float32, 0.0, 1.0)
    lse = extra + np.float32(np.log(BIG_S) + 0.5)
    return q, do, kv, lse, delta


def _p_ds(s, lse, dp, delta, scale, round_to=None):
    """P and dS of scores s (scaled inside), as the kernel forms them; with
    `round_to`, both rounded to it before their products."""
    p = jnp.exp(s * scale - lse)
    ds = p * (dp - delta) * scale
    if round_to is not None:
        p, ds = p.astype(round_to), ds.astype(round_to)
    return p, ds


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9))
def _sampled_dq(q, do, kv, lse, delta, rows, b, h, group, same):
    """dq of query rows `rows` of (batch b, head h), summed over every key."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    k, v = kv[0][b, :, h // group], kv[1][b, :, h // group]
    qr, dor = q[b, :, h][rows], do[b, :, h][rows]
    s = jnp.einsum("rd,td->rt", qr, k, preferred_element_type=f32, precision=hi)
    dp = jnp.einsum("rd,td->rt", dor, v, preferred_element_type=f32, precision=hi)
    _, ds = _p_ds(s, lse[b, h][rows][:, None], dp, delta[b, h][rows][:, None],
                  BIG_D ** -0.5, jnp.bfloat16 if same else None)
    kk = k if same else k.astype(f32)
    return jnp.einsum("rt,td->rd", ds, kk, preferred_element_type=f32, precision=hi)


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9))
def _sampled_dkv(q, do, kv, lse, delta, rows, b, hk, group, same):
    """(dk, dv) of K/V rows `rows` of (batch b, K/V head hk), summed over
    every query row of every query head of its group."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    heads = slice(hk * group, (hk + 1) * group)
    qg, dog = q[b, :, heads], do[b, :, heads]  # [S, g, D]
    k, v = kv[0][b, :, hk][rows], kv[1][b, :, hk][rows]
    s = jnp.einsum("sgd,rd->gsr", qg, k, preferred_element_type=f32, precision=hi)
    dp = jnp.einsum("sgd,rd->gsr", dog, v, preferred_element_type=f32, precision=hi)
    p, ds = _p_ds(s, lse[b, heads][:, :, None], dp, delta[b, heads][:, :, None],
                  BIG_D ** -0.5, jnp.bfloat16 if same else None)
    cast = (lambda x: x) if same else (lambda x: x.astype(f32))
    dv = jnp.einsum("gsr,sgd->rd", p, cast(dog), preferred_element_type=f32, precision=hi)
    dk = jnp.einsum("gsr,sgd->rd", ds, cast(qg), preferred_element_type=f32, precision=hi)
    return dk, dv


@pytest.mark.parametrize("hkv", [16, 128])
def test_64_bit_offsets_one_gpu(hkv):
    _need_kernel()
    seed = fresh_seed()
    group = BIG_HQ // hkv
    cfg = _cfg(1, False, "contiguous", BIG_D)
    q, do, kv, lse, delta = _big_inputs(seed, hkv)
    dq, dk_all, dv_all = jax.jit(block_bwd, static_argnums=(8,))(
        q, do, lse, delta, *kv, jnp.int32(0), jnp.int32(0), cfg)
    rng = np.random.default_rng(seed)
    pick = lambda: jnp.asarray(np.unique(np.concatenate(
        [[0, BIG_S // 2 + 3, BIG_S - 1], rng.integers(0, BIG_S, 5)])).astype(np.int32))
    got, exact, same = {"dq": [], "dk": [], "dv": []}, {"dq": [], "dk": [], "dv": []}, \
        {"dq": [], "dk": [], "dv": []}
    for b in range(BIG_B):
        rows = pick()
        for h in (0, 77, BIG_HQ - 1):
            got["dq"].append(dq[b, :, h][rows])
            exact["dq"].append(_sampled_dq(q, do, kv, lse, delta, rows, b, h, group, False))
            same["dq"].append(_sampled_dq(q, do, kv, lse, delta, rows, b, h, group, True))
        for hk in (0, hkv - 1):
            got["dk"].append(dk_all[b, :, hk][rows])
            got["dv"].append(dv_all[b, :, hk][rows])
            for want, flag in ((exact, False), (same, True)):
                dk, dv = _sampled_dkv(q, do, kv, lse, delta, rows, b, hk, group, flag)
                want["dk"].append(dk)
                want["dv"].append(dv)
    what = f"hkv={hkv} (seed {seed})"
    for name in ("dq", "dk", "dv"):
        g, e, s = (np.concatenate([np.asarray(x) for x in d[name]]) for d in (got, exact, same))
        assert np.all(np.isfinite(g)), f"{name}: non-finite elements: {what}"
        err, base = _rel(g, e), _rel(s, e)
        assert err <= 1.5 * base + 2e-3, (
            f"{name}: rel err {err:.3g} against fp32, same-precision {base:.3g}: {what}")
    pk_jax.check_errors()
