"""all_reduce / reduce_scatter checks shared by the GPU tests and the
2-process GPU check: the exact host reference (ranks summed in order, fp32
for 16-bit floats, one rounding: what the kernels promise bit for bit) and
the checks run by every process of a multi-process job.

Run alone across two processes: tests/scripts/gpu_all_reduce_check.py.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.ops.all_reduce.primitive import KERNEL_MECHANISMS
from helpers.multiprocess_util import peer_never_posts

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)
MECHANISMS = (*KERNEL_MECHANISMS, "auto")


def random_operand(rng, shape, dtype) -> np.ndarray:
    """Fresh random values (never zeros) as a numpy array of `dtype`."""
    if np.dtype(dtype) == np.int32:
        return rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32)
    return (rng.standard_normal(shape) * 4).astype(np.float32).astype(dtype)


def exact_sum(shards) -> np.ndarray:
    """sum over ranks 0..n-1 in that order: fp32 adds for 16-bit floats and
    fp32 (one rounding at the end), wrapping int32 adds."""
    dtype = shards[0].dtype
    if dtype == np.int32:
        acc = shards[0].astype(np.uint32)
        for s in shards[1:]:
            acc = acc + s.astype(np.uint32)
        return acc.astype(np.int32)
    acc = shards[0].astype(np.float32)
    for s in shards[1:]:
        acc = acc + s.astype(np.float32)
    return acc.astype(dtype)


def exact_reduce_scatter(shards, rank, dim, tiled, n) -> np.ndarray:
    total = exact_sum(shards)
    if tiled:
        return np.split(total, n, axis=dim)[rank]
    return np.take(total, rank, axis=dim)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def run_multiprocess_checks(mesh, put, sm, local, check, rng) -> None:
    """Every mechanism, dtype and op across the processes of a 2-device mesh,
    bit for bit against exact_sum (so both ranks hold identical bits), a
    1000-call loop, a scan, and a timeout with its collective recovery."""
    n = mesh.devices.size
    for op in ("all_reduce", "reduce_scatter"):
        for mechanism in MECHANISMS:
            for dtype in DTYPES:
                for per_rank in ((3, 40), (2, 4096 + 8)) if op == "all_reduce" else ((4, 1024),):
                    shards = [random_operand(rng, per_rank, dtype) for _ in range(n)]
                    x = np.concatenate(shards)
                    if op == "all_reduce":
                        f = sm(lambda a, m=mechanism: pk_jax.all_reduce(a, "x", mechanism=m),
                               P("x"), P("x"))
                    else:
                        f = sm(lambda a, m=mechanism: pk_jax.reduce_scatter(
                            a, "x", scatter_dimension=1, mechanism=m), P("x"), P("x"))
                    for _ in range(3):  # repeated calls: the epochs advance
                        idx, got = local(f(put(x, P("x"))))
                    rank = (idx[0].start or 0) // per_rank[0]
                    want = (exact_sum(shards) if op == "all_reduce"
                            else exact_reduce_scatter(shards, rank, 1, True, n))
                    check(np.array_equal(bits(got), bits(want)),
                          f"{op} {mechanism} {np.dtype(dtype).name} {per_rank} across "
                          f"processes, bit for bit (rank {rank})")

    # 1000 dependent calls in one program (fori_loop), then a scan of both ops.
    for mechanism in ("one_shot", "two_shot"):
        shards = [rng.integers(0, 1000, size=(64,), dtype=np.int32) for _ in range(n)]

        def chain(a, m=mechanism):
            def body(i, c):
                s = pk_jax.all_reduce(c, "x", mechanism=m)
                return (s * 3 + c + i) % 100003
            return lax.fori_loop(0, 1000, body, a)
        t0 = time.perf_counter()
        idx, got = local(sm(chain, P("x"), P("x"))(put(np.concatenate(shards), P("x"))))
        seconds = time.perf_counter() - t0
        cs = [s.astype(np.int64) for s in shards]
        for i in range(1000):
            total = sum(cs)
            cs = [(total * 3 + c + i) % 100003 for c in cs]
        rank = (idx[0].start or 0) // 64
        check(np.array_equal(got, cs[rank].astype(np.int32)),
              f"1000 all_reduce {mechanism} calls in a loop ({seconds:.1f} s with compile)")

    shards = [random_operand(rng, (8, 256), jnp.float32) for _ in range(n)]

    def scanned(a):
        def body(c, _):
            s = pk_jax.all_reduce(c, "x")
            part = pk_jax.reduce_scatter(c, "x", scatter_dimension=1)
            return c * 0.5 + 0.125 * s + 0.125 * jnp.tile(part, (1, n)), s[0, 0]
        return lax.scan(body, a, None, length=20)[0]
    idx, got = local(sm(scanned, P("x"), P("x"))(put(np.concatenate(shards), P("x"))))
    cs = list(shards)
    for _ in range(20):
        s = exact_sum(cs)
        w = s.shape[1] // n
        cs = [c * np.float32(0.5) + np.float32(0.125) * s
              + np.float32(0.125) * np.tile(s[:, r * w:(r + 1) * w], (1, n))
              for r, c in enumerate(cs)]
    rank = (idx[0].start or 0) // 8
    check(np.allclose(got, cs[rank], rtol=1e-5, atol=1e-4),
          "a scan of 20 all_reduce + reduce_scatter steps across processes")

    # A peer that never posts: the waits give up, check_errors raises on every
    # process, and the next call is right.
    x = np.concatenate([random_operand(rng, (1 << 14,), jnp.float32) for _ in range(n)])
    two_shot = lambda: sm(lambda a: pk_jax.all_reduce(a, "x", mechanism="two_shot"),
                          P("x"), P("x"))
    with peer_never_posts("all_reduce"):
        two_shot()(put(x, P("x"))).block_until_ready()
    idx, got = local(two_shot()(put(x, P("x"))))
    check(np.array_equal(bits(got), bits(exact_sum(np.split(x, n)))),
          "all_reduce after the collective reset is right")
    pk_jax.check_errors()


def check_fresh_buffers(mesh, mechanism: str, calls: int = 3) -> None:
    """all_reduce then reduce_scatter compiled once and called on fresh inputs
    (new buffer addresses: under command buffers XLA re-traces the handler
    and updates the CUDA graph in place), bit for bit against exact_sum."""
    from jax.sharding import NamedSharding
    n = mesh.devices.size
    f = jax.jit(jax.shard_map(
        lambda a: (pk_jax.all_reduce(a, "x", mechanism=mechanism),
                   pk_jax.reduce_scatter(a, "x", scatter_dimension=1, mechanism=mechanism)),
        mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")), check_vma=False))
    from helpers.gpu_util import captured
    rng = np.random.default_rng()
    kept = []  # every result stays alive: no call gets the previous call's buffers back
    for i in range(calls):
        shards = [random_operand(rng, (3, 64 * n), jnp.bfloat16) for _ in range(n)]
        x = jax.device_put(np.concatenate(shards), NamedSharding(mesh, P("x")))
        if i == 0:  # the premise: the calls are in a command buffer (a graph to update)
            targets = captured(f.lower(x)).targets
            assert "pk_all_reduce" in targets, f"not in a command buffer: {sorted(targets)}"
        total, part = f(x)
        kept.append((x, total, part))
        want_part = np.concatenate([exact_reduce_scatter(shards, r, 1, True, n)
                                    for r in range(n)])
        assert np.array_equal(bits(total), bits(np.concatenate([exact_sum(shards)] * n))), \
            f"all_reduce {mechanism}, call {i}"
        assert np.array_equal(bits(part), bits(want_part)), f"reduce_scatter {mechanism}, call {i}"
    pk_jax.check_errors()

