"""pk_jax.ring_attention on GPUs (mechanisms "auto", "copy_engine" and
"ld_st") against jax.nn.dot_product_attention on the gathered sequence computed in
float32 from the upcast inputs, with a tolerance set by the same attention
computed from the bf16/fp16 inputs (what any correct half-precision
implementation can reach). Causal and not, zigzag and contiguous layouts,
GQA, head dims 64 and 128, S_local 128 to 64k, B > 1, world sizes 1 and 2,
the kernel's tile forms (persistent CTAs on one GPU up to 2048 tokens), calls
repeated inside lax.scan, the log-sum-exp, and the documented behaviour on
shapes the kernel does not take. Skipped with a reason when there are too
few GPUs.

Inputs are fresh every run: each test draws a seed from numpy's default_rng
and names it in its failure messages (`PK_JAX_TEST_SEED=<seed>` reruns a
failure with that seed: tests/helpers/seeds.py).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _warnings, tuning
from pk_jax.ops.ring_attention.primitive import KERNEL_MECHANISMS
from conftest import gpu_mesh, rel_err
from helpers.gpu_util import poison_allocator
from helpers.seeds import fresh_seed

pytestmark = pytest.mark.gpu

SEQ = P(None, "sp")
LSE = P(None, None, "sp")
# The kernel's mechanisms ("auto" resolves to copy_engine: test_supported_auto_takes_the_kernel).
MECHANISMS = list(KERNEL_MECHANISMS)
FULL_CHECK_MAX_S = 4096  # above: check sampled query rows against the whole sequence


# ---- inputs and references -----------------------------------------------------
def _qkv(seed: int, b: int, s: int, hq: int, hkv: int, d: int, dtype):
    """Global (natural order) q, k, v of `dtype`, drawn on the first GPU."""
    keys = jax.random.split(jax.random.key(seed), 3)
    draw = lambda kk, h: jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    return draw(keys[0], hq), draw(keys[1], hkv), draw(keys[2], hkv)


def _rows(s: int, n: int, seed: int) -> np.ndarray:
    """Query rows to check: all of them for short sequences; otherwise both
    ends of every zigzag chunk and of every rank's block, and random rows."""
    if s <= FULL_CHECK_MAX_S:
        return np.arange(s, dtype=np.int32)
    c = s // (2 * n)
    ends = [x for i in range(2 * n) for x in (i * c, (i + 1) * c - 1)]
    extra = np.random.default_rng(seed).integers(0, s, 64)
    return np.unique(np.concatenate([ends, [0, s - 1], extra])).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _attention_rows(q, k, v, rows, causal: bool, dtype, exact: bool):
    """jax.nn.dot_product_attention of the query rows `rows` (natural
    positions) against the whole sequence, inputs cast to `dtype`; `exact`:
    full-precision fp32 matmuls (no TF32), otherwise XLA's default."""
    qr = jnp.take(q, rows, axis=1)
    mask = None
    if causal:
        mask = (rows[:, None] >= jnp.arange(k.shape[1])[None, :])[None, None]
    with jax.default_matmul_precision("highest") if exact else contextlib.nullcontext():
        return jax.nn.dot_product_attention(qr.astype(dtype), k.astype(dtype),
                                            v.astype(dtype), mask=mask)


@functools.partial(jax.jit, static_argnums=(3,))
def _lse_rows(q, k, rows, causal: bool):
    """float32 log-sum-exp [B, Hq, R] of the scaled scores of rows `rows`."""
    qr = jnp.take(q, rows, axis=1).astype(jnp.float32)
    g = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("brhd,bshd->bhrs", qr, kk, precision=lax.Precision.HIGHEST)
    s = s / np.sqrt(q.shape[3])
    if causal:
        s = jnp.where(rows[:, None] >= jnp.arange(k.shape[1])[None, :], s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


def _worst_row(a, b) -> float:
    """Worst relative error of one token (sequence axis 1) over its heads and dims."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    axes = tuple(range(2, a.ndim))
    ref = np.sqrt(np.sum(b * b, axis=axes))
    return float(np.max(np.sqrt(np.sum((a - b) ** 2, axis=axes)) / np.maximum(ref, ref.mean())))


def _check(out, q, k, v, causal, what, seed, n=2, lse=None):
    """`out` (natural order) against fp32 attention; tolerance from the same
    attention on the half-precision inputs. `lse` [B, Hq, S]: against an fp32
    log-sum-exp."""
    rows = _rows(q.shape[1], n, seed)
    r = jnp.asarray(rows)
    exact = _attention_rows(q, k, v, r, causal, jnp.float32, True)
    same_precision = _attention_rows(q, k, v, r, causal, q.dtype, False)
    got = jnp.take(out, r, axis=1)
    err, base = rel_err(got, exact), rel_err(same_precision, exact)
    assert out.shape == q.shape and out.dtype == q.dtype, f"{what}: {out.shape} {out.dtype}"
    assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{what}: non-finite (seed {seed})"
    assert err <= 1.5 * base + 2e-3, (
        f"{what}: rel err {err:.3g} against fp32, same-precision attention {base:.3g} "
        f"(seed {seed}, {len(rows)} rows)")
    row, row_base = _worst_row(got, exact), _worst_row(same_precision, exact)
    assert row <= 2 * row_base + 1e-2, (
        f"{what}: worst token rel err {row:.3g}, same-precision attention {row_base:.3g} "
        f"(seed {seed})")
    if lse is not None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
        want = _lse_rows(q, k, r, causal)
        diff = float(jnp.max(jnp.abs(jnp.take(lse, r, axis=2) - want)))
        assert diff <= 2e-2, f"{what}: lse max abs err {diff:.3g} (seed {seed})"


# ---- the op under test -----------------------------------------------------------
def _ring(mesh, *, causal: bool, layout: str, mechanism: str, return_lse: bool = False,
          num_comm_ctas: int | None = None):
    """Global natural-order (q, k, v) -> natural-order output (and lse) through
    pk_jax.ring_attention on `mesh` (axis "sp")."""
    n = mesh.size
    f = jax.jit(jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal, layout=layout,
                                              return_lse=return_lse, mechanism=mechanism,
                                              num_comm_ctas=num_comm_ctas),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=(SEQ, LSE) if return_lse else SEQ))
    sharding = NamedSharding(mesh, SEQ)

    def run(q, k, v):
        if layout == "zigzag":
            q, k, v = (pk_jax.zigzag_shard(x, n) for x in (q, k, v))
        res = f(*(jax.device_put(x, sharding) for x in (q, k, v)))
        out, lse = res if return_lse else (res, None)
        if layout == "zigzag":
            out = pk_jax.zigzag_unshard(out, n)
            lse = None if lse is None else pk_jax.zigzag_unshard(lse, n, seq_axis=2)
        out = jax.device_put(out, mesh.devices.flat[0])
        lse = None if lse is None else jax.device_put(lse, mesh.devices.flat[0])
        return (out, lse) if return_lse else out
    return run


def _run_and_check(n, mechanism, causal, layout, b, s_local, hq, hkv, d, dtype, what):
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, b, n * s_local, hq, hkv, d, dtype)
    poison_allocator(mesh, q.size * q.dtype.itemsize // n + 4096)
    out = _ring(mesh, causal=causal, layout=layout, mechanism=mechanism)(q, k, v)
    _check(out, q, k, v, causal, what, seed, n)
    pk_jax.check_errors()


CASES = [(False, "contiguous"), (True, "contiguous"), (True, "zigzag"), (False, "zigzag")]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("causal,layout", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_values(n, mechanism, causal, layout, dtype):
    _run_and_check(n, mechanism, causal, layout, 2, 256, 8, 2, 128, dtype,
                   f"n={n} {mechanism} causal={causal} {layout} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_and_head_dim(mechanism, group, d):
    _run_and_check(2, mechanism, True, "zigzag", 2, 512, 8, 8 // group, d, jnp.bfloat16,
                   f"{mechanism} GQA {group} d={d}")


# The kernel's tile forms (ring_attention.cu, form_of): head dim 64 takes
# 192-key tiles on long chunks (1536 rows: whole tiles; 10240: the last tile
# placed at the chunk's end, its repeated keys masked), 128 keys on short
# ones; head dim 128 (its lazy rescale) here causal in fp16; head dim 256
# takes 80-key tiles (1024 rows: the last tile repeats keys; 640: whole tiles).
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("d,causal,layout,s_local,dtype", [
    (64, False, "contiguous", 1536, jnp.bfloat16),
    (64, True, "contiguous", 10240, jnp.float16),
    (64, False, "zigzag", 20480, jnp.bfloat16),
    (64, True, "zigzag", 1024, jnp.bfloat16),
    (128, True, "contiguous", 2048, jnp.float16),
    (256, True, "contiguous", 1024, jnp.bfloat16),
    (256, False, "zigzag", 1280, jnp.float16),
])
def test_tile_forms(n, mechanism, d, causal, layout, s_local, dtype):
    _run_and_check(n, mechanism, causal, layout, 1, s_local, 4, 2, d, dtype,
                   f"n={n} {mechanism} d={d} causal={causal} {layout} s_local={s_local}")


# Head dim 128 on a ring of one with up to 2048 tokens runs persistent CTAs
# (ring_attention.cu, form_of; one CTA per SM taking query tile after query
# tile in alternating rounds): more tiles than SMs (each CTA several) and
# fewer, both masks, MHA, GQA and MQA, odd counts; 2176 tokens, just past the
# range, the one-tile-a-CTA form.
@pytest.mark.parametrize("causal,b,s_local,hq,hkv,dtype", [
    (True, 8, 2048, 16, 4, jnp.bfloat16),
    (False, 5, 1152, 12, 12, jnp.float16),
    (True, 3, 640, 14, 7, jnp.float16),
    (True, 1, 384, 2, 1, jnp.bfloat16),
    (False, 2, 2176, 8, 2, jnp.bfloat16),
])
def test_persistent_form(causal, b, s_local, hq, hkv, dtype):
    _run_and_check(1, "copy_engine", causal, "contiguous", b, s_local, hq, hkv, 128, dtype,
                   f"one GPU d=128 causal={causal} b={b} s={s_local} {hq}/{hkv} "
                   f"{jnp.dtype(dtype).name}")


# S_local from 128 to 64k; the long ones few (a 64k-token block per GPU).
@pytest.mark.parametrize("mechanism,causal,layout,b,s_local,hq,hkv", [
    ("copy_engine", True, "contiguous", 3, 128, 8, 8),
    ("copy_engine", False, "contiguous", 2, 1024, 16, 4),
    ("auto", True, "zigzag", 2, 4096, 16, 2),
    ("copy_engine", True, "contiguous", 1, 8192, 16, 16),
    ("auto", False, "contiguous", 1, 16384, 8, 8),
    ("ld_st", True, "zigzag", 1, 16384, 16, 4),
    ("copy_engine", True, "zigzag", 1, 65536, 8, 1),
    ("auto", False, "contiguous", 1, 65536, 4, 4),
])
def test_sequence_lengths(mechanism, causal, layout, b, s_local, hq, hkv):
    _run_and_check(2, mechanism, causal, layout, b, s_local, hq, hkv, 128, jnp.bfloat16,
                   f"{mechanism} causal={causal} {layout} b={b} s_local={s_local}")


# Small pieces (8 per block) on small blocks: MQA, GQA and MHA blocks, odd
# head counts, batches > 1 (one copy per batch row per piece), both layouts.
@pytest.mark.parametrize("causal,layout,b,s_local,hq,hkv,d", [
    (True, "zigzag", 2, 1024, 8, 1, 128),
    (False, "contiguous", 1, 2048, 16, 2, 64),
    (True, "contiguous", 3, 512, 8, 8, 128),
    (False, "zigzag", 2, 1024, 16, 8, 64),
    (True, "contiguous", 1, 1024, 6, 3, 128),
])
def test_small_pieces(monkeypatch, causal, layout, b, s_local, hq, hkv, d):
    from pk_jax.ops.ring_attention import primitive as prim
    monkeypatch.setattr(prim, "PIECE_BYTES", 1024)  # always the most pieces
    _run_and_check(2, "copy_engine", causal, layout, b, s_local, hq, hkv, d, jnp.bfloat16,
                   f"small pieces, causal={causal} {layout} b={b} hkv={hkv} d={d}")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("causal,layout", CASES[:3])
def test_return_lse(n, mechanism, causal, layout):
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 2, n * 512, 8, 2, 128, jnp.bfloat16)
    out, lse = _ring(mesh, causal=causal, layout=layout, mechanism=mechanism,
                     return_lse=True)(q, k, v)
    _check(out, q, k, v, causal, f"lse n={n} {mechanism} causal={causal} {layout}", seed, n,
           lse=lse)
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("n", [1, 2])
def test_repeated_in_scan(mechanism, n):
    """Layers of ring attention in one lax.scan (the kernel's per-call state
    must advance inside one program), and the program called twice."""
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    layers = 6
    q, k, v = _qkv(seed, 2, n * 256, 8, 2, 128, jnp.bfloat16)

    def stacked(x, kk, vv):
        step = lambda c, _: (pk_jax.ring_attention(c, kk, vv, "sp", causal=True, layout="zigzag",
                                                   mechanism=mechanism) * 4.0, None)
        return lax.scan(step, x, None, length=layers)[0]

    f = jax.jit(jax.shard_map(stacked, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ))
    sharding = NamedSharding(mesh, SEQ)
    args = [jax.device_put(pk_jax.zigzag_shard(x, n), sharding) for x in (q, k, v)]

    def reference(dtype, exact):
        c = q.astype(dtype)
        with jax.default_matmul_precision("highest") if exact else contextlib.nullcontext():
            for _ in range(layers):
                c = (jax.nn.dot_product_attention(c, k.astype(dtype), v.astype(dtype),
                                                  is_causal=True) * 4.0).astype(dtype)
        return c
    exact, same_precision = reference(jnp.float32, True), reference(q.dtype, False)
    base = rel_err(same_precision, exact)
    outs = []
    for call in ("first", "second"):
        out = jax.device_put(pk_jax.zigzag_unshard(f(*args), n), mesh.devices.flat[0])
        outs.append(np.asarray(out, np.float32))
        err = rel_err(out, exact)
        assert err <= 1.5 * base + 2e-3, (f"scan {mechanism} n={n}, {call} call: {err=:.3g} "
                                          f"{base=:.3g} (seed {seed})")
    # The kernel's summation order is fixed: a second call that differs means
    # state leaked between calls, not rounding.
    assert np.array_equal(outs[0], outs[1]), f"scan {mechanism} n={n}: calls differ (seed {seed})"
    pk_jax.check_errors()


# ---- shapes the kernel does not take ---------------------------------------------
# Documented contract: "auto" falls back (to the ring of cuDNN blocks where
# they take the shape, as bf16 head dim 32, else the pure-JAX ring) with a
# one-time PkJaxFallbackWarning saying why; an explicit "copy_engine" raises a ValueError
# that says what the kernel supports. float32 inputs (kernel: bf16 / fp16) and
# head dim 32 (kernel: 64, 128, 256) are outside it. The error must name the
# offending value and what the kernel takes (the words listed).
UNSUPPORTED = [pytest.param(jnp.float32, 128, ["float32", "bfloat16", "float16"], id="float32"),
               pytest.param(jnp.bfloat16, 32, ["32", "64", "128", "256"], id="head_dim_32")]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget the one-time warnings already given, so this test sees its own."""
    monkeypatch.setattr(_warnings, "_seen", set())


@pytest.mark.parametrize("dtype,d,_", UNSUPPORTED)
def test_unsupported_auto_falls_back(fresh_warnings, dtype, d, _):
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, 512, 4, 2, d, dtype)
    with pytest.warns(pk_jax.PkJaxFallbackWarning):
        out = _ring(mesh, causal=True, layout="zigzag", mechanism="auto")(q, k, v)
    _check(out, q, k, v, True, f"fallback {jnp.dtype(dtype).name} d={d}", seed)
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("dtype,d,words", UNSUPPORTED)
def test_unsupported_kernel_mechanism_raises(dtype, d, words, mechanism):
    mesh = gpu_mesh(2, "sp")
    q, k, v = _qkv(fresh_seed(), 1, 512, 4, 2, d, dtype)
    with pytest.raises(ValueError, match=mechanism) as info:
        _ring(mesh, causal=True, layout="zigzag", mechanism=mechanism)(q, k, v)
    missing = [w for w in words if not re.search(rf"\b{w}\b", str(info.value))]
    assert not missing, f"the error should name {missing}: {info.value}"


def test_supported_auto_takes_the_kernel(fresh_warnings):
    """On a supported shape "auto" must not fall back (no fallback warning)."""
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, 1024, 8, 2, 128, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pk_jax.PkJaxFallbackWarning)
        out = _ring(mesh, causal=True, layout="zigzag", mechanism="auto")(q, k, v)
    _check(out, q, k, v, True, "auto on a supported shape", seed)
    pk_jax.check_errors()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_timeout_raises_and_recovers(mechanism):
    """A peer that never posts its K/V (ld_st: its communicator CTAs push
    but never post): the waiting rank's kernel gives up after the timeout
    (later CTAs at once), the error names the op and the peer, and after
    check_errors() the next call is correct again."""
    from pk_jax import runtime
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, 2 * 2048, 8, 2, 128, jnp.bfloat16)
    with pk_jax.configured(timeout_s=0.2):
        with runtime.testing_skip_post(1):
            ring = _ring(mesh, causal=False, layout="contiguous", mechanism=mechanism)
            jax.block_until_ready(ring(q, k, v))
        with pytest.raises(pk_jax.PkJaxTimeoutError, match="ring_attention.*peer rank 1"):
            pk_jax.check_errors()
    out = _ring(mesh, causal=True, layout="contiguous", mechanism=mechanism)(q, k, v)
    _check(out, q, k, v, True, f"{mechanism} after a timeout", seed)
    pk_jax.check_errors()


@pytest.mark.parametrize("ctas", [1, 7, 32])
def test_ld_st_comm_ctas(ctas):
    """ld_st with 1, an odd count and the most communicator CTAs, on a block
    posted in 4 pieces (16 MiB of K per rank), called twice: every piece is
    posted once all CTAs pushed their share, and the arrival counters' targets
    advance with the epoch (the second call must not post early)."""
    mesh = gpu_mesh(2, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, 2 * 8192, 8, 8, 128, jnp.bfloat16)
    ring = _ring(mesh, causal=True, layout="zigzag", mechanism="ld_st", num_comm_ctas=ctas)
    for call in ("first", "second"):
        _check(ring(q, k, v), q, k, v, True, f"ld_st {ctas} CTAs, {call} call", seed)
    pk_jax.check_errors()


# ---- 64-bit offsets: the largest shape one H200 holds ------------------------------
# q, k, v [2, 131072, 128, 128] bf16, 8 GiB each: every batch stride S * H * D
# is 2^31 elements, so batch entry 1 starts where a 32-bit stride wraps (the
# kernels' strides were `int` before). About 35 GB of GPU memory in all; the
# check samples (batch, head, row) triples against fp32 attention over the
# whole sequence (a dense reference would need S^2 scores per head).
BIG_B, BIG_S, BIG_HEADS, BIG_D = 2, 131072, 128, 128


@functools.partial(jax.jit, static_argnums=(0,))
def _draw_bf16(shape, key):
    return jax.random.normal(key, shape, jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _sampled_attention(q, k, v, rows, b, h, group, causal):
    """(exact out, same-precision out, exact lse) of query rows `rows` of
    (batch b, head h) against the whole sequence: fp32 products of the bf16
    inputs, and the same with P rounded to bf16 as the kernel does."""
    f32 = jnp.float32
    qr = q[b, :, h][rows]
    kh, vh = k[b, :, h // group], v[b, :, h // group]
    sc = jnp.einsum("rd,td->rt", qr, kh, preferred_element_type=f32,
                    precision=lax.Precision.HIGHEST) / np.sqrt(q.shape[3])
    if causal:
        sc = jnp.where(rows[:, None] >= jnp.arange(k.shape[1])[None, :], sc, -jnp.inf)
    lse = jax.nn.logsumexp(sc, axis=-1)
    p = jnp.exp(sc - lse[:, None])
    exact = jnp.einsum("rt,td->rd", p, vh.astype(f32), precision=lax.Precision.HIGHEST)
    same = jnp.einsum("rt,td->rd", p.astype(jnp.bfloat16), vh, preferred_element_type=f32,
                      precision=lax.Precision.HIGHEST)
    return exact, same, lse


@pytest.mark.parametrize("causal", [False, True])
def test_64_bit_offsets_one_gpu(causal):
    from pk_jax import runtime
    mesh = gpu_mesh(1, "sp")
    if not runtime.available() or not runtime.extension().has_gemm:
        pytest.skip("pk_jax extension without CUTLASS kernels")
    seed = fresh_seed()
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (BIG_B, BIG_S, BIG_HEADS, BIG_D)
    q, k, v = (_draw_bf16(shape, kk) for kk in keys)
    out, lse = _ring(mesh, causal=causal, layout="contiguous", mechanism="copy_engine",
                     return_lse=True)(q, k, v)
    rng = np.random.default_rng(seed)
    rows = np.unique(np.concatenate([[0, 1, BIG_S // 2, BIG_S - 1],
                                     rng.integers(0, BIG_S, 12)])).astype(np.int32)
    r = jnp.asarray(rows)
    errs, bases, lse_err = [], [], 0.0
    for b in range(BIG_B):
        for h in (0, 77, BIG_HEADS - 1):
            exact, same, want_lse = _sampled_attention(q, k, v, r, b, h, 1, causal)
            got = out[b, :, h][r].astype(jnp.float32)
            what = f"batch {b} head {h} causal={causal} (seed {seed})"
            assert np.all(np.isfinite(np.asarray(got))), f"non-finite output: {what}"
            errs.append(rel_err(got, exact))
            bases.append(rel_err(same, exact))
            lse_err = max(lse_err, float(jnp.max(jnp.abs(lse[b, h][r] - want_lse))))
    err, base = max(errs), max(bases)
    assert err <= 1.5 * base + 2e-3, f"rel err {err:.3g}, same precision {base:.3g} (seed {seed})"
    assert lse_err <= 2e-2, f"lse max abs err {lse_err:.3g} (seed {seed})"
    pk_jax.check_errors()


# ---- the ring of cuDNN blocks (mechanism "cudnn") ----------------------------------
def _grad_check(ring, q, k, v, causal, what, seed):
    """Gradients of sum(ring(q, k, v) * w) against fp32 attention on the
    whole sequence (relative L2 per tensor, the gradient tolerance 3e-2)."""
    w = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.float32)
    loss = lambda f: lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w)
    exact = lambda *x: jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in x),
                                                    is_causal=causal)
    got = jax.grad(loss(ring), (0, 1, 2))(q, k, v)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.grad(loss(exact), (0, 1, 2)))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == q.dtype, f"{what} {name}: {a.shape} {a.dtype}"
        err = rel_err(a, b)
        assert err < 3e-2, f"{what} {name}: rel err {err:.3g} (seed {seed})"


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("causal,layout", CASES)
@pytest.mark.parametrize("d,hkv,dtype", [(256, 2, jnp.bfloat16), (128, 8, jnp.float16),
                                         (96, 1, jnp.bfloat16)])
def test_cudnn_ring(n, causal, layout, d, hkv, dtype):
    """mechanism="cudnn": values and gradients, a head dim the fused kernel
    does not take (96) and ones it does, GQA / MHA / MQA."""
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 2, n * 512, 8, hkv, d, dtype)
    what = f"cudnn ring n={n} causal={causal} {layout} d={d} hkv={hkv}"
    ring = _ring(mesh, causal=causal, layout=layout, mechanism="cudnn")
    _check(ring(q, k, v), q, k, v, causal, what, seed, n)
    _grad_check(ring, q, k, v, causal, what, seed)


@pytest.mark.parametrize("n", [1, 2])
def test_auto_runs_the_kernel_at_head_dim_256(fresh_warnings, n):
    """`auto` at head dim 256 with return_lse (so not cuDNN's whole attention
    on one device): the fused kernel, no fallback warning, the log-sum-exp
    checked."""
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, n * 1024, 8, 2, 256, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pk_jax.PkJaxFallbackWarning)
        out, lse = _ring(mesh, causal=True, layout="zigzag", mechanism="auto",
                         return_lse=True)(q, k, v)
    _check(out, q, k, v, True, f"auto d256 n={n}", seed, n, lse=lse)
    pk_jax.check_errors()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("causal,layout", CASES[:3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_grads(n, mechanism, causal, layout, dtype):
    """Head dim 256 (the block backward kernel takes 64 and 128): the fused
    forward kernel, its backward ring's steps cuDNN's block backward fed the
    kernel's output and log-sum-exp; the program must hold both (the
    kernel's custom call and cuDNN's), the gradients match fp32 attention."""
    mesh = gpu_mesh(n, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 1, n * 512, 8, 2, 256, dtype)
    f = jax.shard_map(
        lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal, layout=layout,
                                              mechanism=mechanism),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    w = jax.random.normal(jax.random.key(seed + 2), q.shape, jnp.float32)
    text = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w))).lower(
        q, k, v).as_text()
    assert "pk_ring_attention" in text and "cudnn" in text, "not the kernel + cuDNN blocks"
    what = f"d256 n={n} {mechanism} causal={causal} {layout} {jnp.dtype(dtype).name}"
    ring = _ring(mesh, causal=causal, layout=layout, mechanism=mechanism)
    _check(ring(q, k, v), q, k, v, causal, what, seed, n)
    _grad_check(ring, q, k, v, causal, what, seed)
    pk_jax.check_errors()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", ["own", "earlier", "later"])
def test_cudnn_blocks_with_the_ring_statistics(d, case):
    """The cuDNN calls of each ring step (ops/ring_attention/cudnn.py: _block_fwd and
    _block_bwd, as the ring shapes them) on one GPU against fp32 einsums:
    the forward's log-sum-exp, and the backward fed statistics over more keys
    than the block (those of the whole ring), which must give the block's
    share of the gradients. Rings of two or more GPUs run exactly these
    calls; this checks them where only one GPU is present. The lowered
    program must hold cuDNN's custom call (not the einsum branch)."""
    from pk_jax import reference
    from pk_jax.ops.ring_attention import cudnn as rc
    gpu_mesh(1, "sp")  # skips without a GPU
    seed = fresh_seed()
    t, s = {"own": (512, 512), "earlier": (512, 256), "later": (256, 512)}[case]
    causal = case == "own"
    extra = 384  # keys of other blocks, all visible to these queries (earlier positions)
    keys = jax.random.split(jax.random.key(seed), 6)
    draw = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
    q, dout = draw(keys[0], (2, t, 8, d)), draw(keys[1], (2, t, 8, d))
    kb, vb = draw(keys[2], (2, s, 2, d)), draw(keys[3], (2, s, 2, d))
    ke, ve = draw(keys[4], (2, extra, 2, d)), draw(keys[5], (2, extra, 2, d))
    scale = d ** -0.5
    q_pos = extra + jnp.arange(t)
    k_pos = extra + jnp.arange(s)
    # the ring's statistics: over this block and the `extra` keys
    out_g, lse_g = reference.attention_block(
        q, jnp.concatenate([ke, kb], 1), jnp.concatenate([ve, vb], 1), causal=causal,
        scale=scale, q_pos=q_pos, k_pos=jnp.concatenate([jnp.arange(extra), k_pos]))
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out_g.astype(jnp.float32))
    fwd = jax.jit(lambda *a: rc._block_fwd((), *a, causal, scale))
    bwd = jax.jit(lambda *a: rc._block_bwd((), *a, causal, scale))
    for f, args in ((fwd, (q, kb, vb)), (bwd, (q, kb, vb, out_g, lse_g, dout, delta))):
        text = f.lower(*args).as_text()
        assert "cudnn" in text, f"{case} d={d}: no cuDNN custom call in the lowered program"
    out, lse = fwd(q, kb, vb)
    want_out, want_lse = reference.attention_block(q, kb, vb, causal=causal, scale=scale)
    assert rel_err(out, want_out) < 2e-2, f"{case} d={d}: block output (seed {seed})"
    assert float(jnp.max(jnp.abs(lse - want_lse))) < 2e-2, f"{case} d={d}: lse (seed {seed})"
    got = bwd(q, kb, vb, out_g, lse_g, dout, delta)
    want = reference.attention_block_grads(q, dout, lse_g, delta, kb, vb, q_pos, k_pos,
                                           causal=causal, scale=scale)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == jnp.float32 and a.shape == b.shape, f"{case} {name}: {a.shape}"
        err = rel_err(a, b)
        assert err < 3e-2, f"{case} d={d} {name}: rel err {err:.3g} (seed {seed})"


def _one_device_auto(causal, d, hkv, dtype, what):
    """ring_attention under `auto` on a ring of one device (2 x 1024 tokens, 8
    query heads): values and gradients checked against fp32 attention; the
    text of its lowered gradient (what the choice put in it). Lowered here,
    so inside a tuning.forced block it takes the forced choice."""
    mesh = gpu_mesh(1, "sp")
    seed = fresh_seed()
    q, k, v = _qkv(seed, 2, 1024, 8, hkv, d, dtype)
    f = jax.shard_map(lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    w = jnp.ones(q.shape, jnp.float32)
    text = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w))).lower(
        q, k, v).as_text()
    ring = _ring(mesh, causal=causal, layout="contiguous", mechanism="auto")
    _check(ring(q, k, v), q, k, v, causal, what, seed, 1)
    _grad_check(ring, q, k, v, causal, what, seed)
    return text


@pytest.mark.parametrize("choice", tuning.SINGLE_GPU_ATTENTION_CHOICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,hkv,dtype", [(64, 8, jnp.bfloat16), (128, 2, jnp.float16),
                                         (256, 8, jnp.bfloat16)])
def test_one_device_choices(choice, causal, d, hkv, dtype):
    """Each of tuning.single_gpu_attention's choices on a ring of one device
    under `auto` (forced): values and gradients against fp32 attention, and
    the lowered backward holds what the choice names (cuDNN's attention
    alone; pk's forward kernel and its block backward; pk's forward kernel
    and cuDNN's)."""
    what = f"one device {choice} causal={causal} d={d} hkv={hkv} {jnp.dtype(dtype).name}"
    with tuning.forced(single_gpu_attention=choice):
        text = _one_device_auto(causal, d, hkv, dtype, what)
    kernel_bwd = d != 256 and choice == "kernel"  # the block kernel takes 64 and 128
    assert ("pk_ring_attention" in text) == (choice != "cudnn"), what
    assert ("pk_attention_block_bwd" in text) == kernel_bwd, what
    assert ("cudnn" in text) == (not kernel_bwd), what
    pk_jax.check_errors()


@pytest.mark.parametrize("hkv", [2, 8])
def test_one_device_auto_follows_the_gqa_rule(hkv):
    """Unforced `auto` on one device, head dim 128, full mask: with a GQA group
    of 4 (tuning.SINGLE_GPU_ATTENTION_KERNEL_BWD) the backward is pk's block
    kernel, without GQA cuDNN's; values and gradients against fp32 attention."""
    what = f"one device auto full d=128 hkv={hkv}"
    text = _one_device_auto(False, 128, hkv, jnp.bfloat16, what)
    assert ("pk_attention_block_bwd" in text) == (hkv == 2), what
    pk_jax.check_errors()
