"""Random calls of every op (shapes, dtypes, axis sizes, mechanisms, layouts;
fresh each run, the seed in the failure message): each one either equals
the pure-lax result on CPU devices and lowers for CUDA (cross-lowered with
a stand-in for the extension), or raises a clear error naming pk_jax.
Never a crash, a hang, or a silently different answer. To replay a failure,
set PK_JAX_FUZZ_SEED to the seed its message names."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.ops.all_gather import MECHANISMS as AG_MECHANISMS
from pk_jax.ops.ring_attention import MECHANISMS as RING_MECHANISMS
from pk_jax.ops.tp_matmul import MECHANISMS as TP_MECHANISMS
from conftest import cpu_mesh

CLEAR = (ValueError, TypeError, pk_jax.PkJaxError)


def _clear(e: Exception, what: str) -> None:
    """A refusal must say it is pk_jax's and what was wrong."""
    assert isinstance(e, CLEAR) and "pk_jax" in str(e), f"{what}: unclear {type(e).__name__}: {e}"


def _values(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, shape).astype(bool))
    return jnp.asarray(rng.integers(-50, 50, shape), dtype)


def _run(body, reference, mesh, in_specs, out_spec, args):
    """(ours, the reference's) on the CPU mesh, and our CUDA lowering text."""
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                                         check_vma=False))
    return f(body)(*args), f(reference)(*args)


@pytest.fixture
def seed():
    fixed = os.environ.get("PK_JAX_FUZZ_SEED")
    return int(fixed) if fixed else int(np.random.default_rng().integers(1 << 31))


def test_all_gather_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    dtypes = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.float16, jnp.bool_]
    for case in range(150):
        n = int(rng.choice([1, 2, 4, 8]))
        mesh = cpu_mesh((n, 8 // n), ("x", "y"))
        ndim = int(rng.integers(0, 4))
        local = tuple(int(d) for d in rng.integers(1, 6, ndim))
        dtype = dtypes[rng.integers(len(dtypes))]
        tiled = bool(rng.integers(2)) and ndim > 0
        axis = int(rng.integers(-(ndim + 1), ndim + 1))
        mechanism = str(rng.choice(list(AG_MECHANISMS) + ["bogus"]))
        what = f"seed {seed} case {case}: n={n} local={local} {jnp.dtype(dtype).name} " \
               f"axis={axis} tiled={tiled} {mechanism}"
        spec = P("x") if ndim else P()
        shape = ((local[0] * n,) + local[1:]) if ndim else ()
        x = jax.device_put(_values(rng, shape, dtype), NamedSharding(mesh, spec))
        ours = lambda a: pk_jax.all_gather(a, "x", axis=axis, tiled=tiled, mechanism=mechanism)
        ref = lambda a: lax.all_gather(a, "x", axis=axis, tiled=tiled)
        try:
            want = _run(ref, ref, mesh, spec, P(), (x,))[0]
        except Exception:  # lax refuses it too: ours must refuse clearly
            with pytest.raises(Exception) as info:
                _run(ours, ref, mesh, spec, P(), (x,))
            _clear(info.value, what)
            continue
        try:
            got = _run(ours, ref, mesh, spec, P(), (x,))[0]
        except Exception as e:
            _clear(e, what)
            assert mechanism != "auto" and mechanism != "xla", f"{what}: auto/xla refused: {e}"
            continue
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)
        try:
            cuda_lowering(ours, mesh, spec, shape, dtype)
        except Exception as e:
            _clear(e, what + " (CUDA lowering)")


def test_tp_matmuls_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    dtypes = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]
    for case in range(60):
        n = int(rng.choice([1, 2, 4]))
        mesh = cpu_mesh((n,), ("x",))
        m, k, cols = (int(v) for v in rng.choice([1, 3, 8, 16, 24], 3))
        dtype = dtypes[rng.integers(len(dtypes))]
        out = [None, jnp.float32, jnp.bfloat16][rng.integers(3)]
        mechanism = str(rng.choice(list(TP_MECHANISMS) + ["fused"]))
        op = ["ag", "rs"][rng.integers(2)]
        what = f"seed {seed} case {case}: {op} n={n} m={m} k={k} N={cols} " \
               f"{jnp.dtype(dtype).name}->{out} {mechanism}"
        if op == "ag":
            x, w = _values(rng, (n * m, k), dtype), _values(rng, (k, n * cols), dtype)
            specs, out_spec = (P("x"), P(None, "x")), P(None, "x")
            ours = lambda a, b: pk_jax.all_gather_matmul(a, b, "x", mechanism=mechanism,
                                                         preferred_element_type=out)
            ref = lambda a, b: jnp.matmul(lax.all_gather(a, "x", tiled=True), b,
                                          preferred_element_type=out or a.dtype)
        else:
            x, w = _values(rng, (m * n, k * n), dtype), _values(rng, (k * n, cols), dtype)
            specs, out_spec = (P(None, "x"), P("x", None)), P("x")
            ours = lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", mechanism=mechanism,
                                                             preferred_element_type=out)
            ref = lambda a, b: lax.psum_scatter(jnp.matmul(
                a, b, preferred_element_type=jnp.float32).astype(out or a.dtype), "x", tiled=True)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
        try:
            got, want = _run(ours, ref, mesh, specs, out_spec, args)
        except Exception as e:
            _clear(e, what)
            assert mechanism == "fused" or not jnp.issubdtype(dtype, jnp.floating) or \
                mechanism == "chunked", f"{what}: refused a call it takes: {e}"
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, what
        tol = 2e-2 if jnp.dtype(got.dtype).itemsize == 2 else 1e-4
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol * 8, err_msg=what)


def test_ring_attention_random_calls(seed, cuda_lowering):
    rng = np.random.default_rng(seed)
    for case in range(40):
        n = int(rng.choice([1, 2, 3, 4]))
        mesh = cpu_mesh((n,), ("sp",))
        b, s = int(rng.integers(1, 3)), int(rng.choice([0, 1, 2, 6, 8, 16]))
        hkv = int(rng.choice([1, 2, 3]))
        hq = hkv * int(rng.choice([1, 2])) + int(rng.integers(0, 2)) * int(rng.integers(0, 2))
        d = int(rng.choice([8, 16, 64]))
        dtype = [jnp.float32, jnp.bfloat16][rng.integers(2)]
        kv_dtype = dtype if rng.integers(4) else jnp.float16
        causal, layout = bool(rng.integers(2)), str(rng.choice(["contiguous", "zigzag", "x"]))
        mechanism = str(rng.choice(list(RING_MECHANISMS) + ["nccl"]))
        what = f"seed {seed} case {case}: n={n} b={b} s_local={s} hq={hq} hkv={hkv} d={d} " \
               f"{jnp.dtype(dtype).name}/{jnp.dtype(kv_dtype).name} causal={causal} {layout} " \
               f"{mechanism}"
        q = _values(rng, (b, n * s, hq, d), dtype)
        k, v = (_values(rng, (b, n * s, hkv, d), kv_dtype) for _ in range(2))
        seq = NamedSharding(mesh, P(None, "sp"))
        args = [jax.device_put(a, seq) for a in (q, k, v)]
        ours = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=causal,
                                                     layout=layout, mechanism=mechanism)
        f = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                                  out_specs=P(None, "sp"), check_vma=False))
        try:
            got = f(*args)
        except Exception as e:
            _clear(e, what)
            continue
        assert layout in ("contiguous", "zigzag") and kv_dtype == dtype and hq % hkv == 0, \
            f"{what}: accepted an invalid call"
        # Forced kernel mechanisms take only the kernel's shapes (an empty
        # sequence has nothing to compute: every mechanism returns it).
        assert mechanism in ("auto", "xla") or s == 0 or (dtype == jnp.bfloat16 and s % 128 == 0)
        # Both layouts give the same global attention once reordered.
        if layout == "zigzag" and s:
            got = pk_jax.zigzag_unshard(got, n)
            q, k, v = (pk_jax.zigzag_unshard(a, n) for a in (q, k, v))
        want = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)),
                                            is_causal=causal)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol,
                                   atol=tol, err_msg=what)
