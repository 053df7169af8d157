"""One process of an n-process GPU job for the fused ring attention backward
(pk_ring_attention_bwd) on a ring of n ranks, e.g. four processes sharing
one GPU:

    python -m pk_jax.launch -n 4 --gpus-per-process 0 tests/scripts/gpu_ring_bwd_check.py

With n = 4 the ring has 3 steps, so the two K/V slots and the partial slot
of the staging region are reused within a call under the per-slot credits
(n = 2 has one step and reuses nothing). Gradients of both forward
mechanisms and layouts against the float32 dense reference, several calls in
a row (epochs advance; dK/dV bitwise equal from call to call: the fp32 adds
have a fixed order), then a never-posting rank: NaN, check_errors on every
process, and a right answer after the reset. Each process drives GPU i where
there are n GPUs, else all share GPU 0. Prints one line per check; exits
non-zero on the first failure.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # processes may share a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import runtime  # noqa: E402
from helpers.multiprocess_util import check, rel, ring_inputs, ring_vjp  # noqa: E402


def main() -> None:
    n = int(os.environ["PK_JAX_NUM_PROCESSES"])  # set by pk_jax.launch
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    me = int(os.environ["PK_JAX_PROCESS_ID"])
    pk_jax.distributed.initialize(local_device_ids=[me if gpus >= n else 0])
    check(n >= 2, f"a ring of {n} processes")
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
    rng = np.random.default_rng(4321)  # the same global inputs on every process
    cpu = jax.local_devices(backend="cpu")[0]
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16))

    def put(a, spec):  # from this process's shard: no collective
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def reference(q, k, v, cot):
        with jax.default_device(cpu):
            return jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True),
                           q, k, v)[1](cot)

    def mine(g):
        shard, = g.addressable_shards
        return shard.index, np.asarray(shard.data, np.float32)

    for mechanism, layout in (("copy_engine", "contiguous"), ("ld_st", "zigzag")):
        (q, k, v), order, cot = ring_inputs(rng, n, layout, bf, cpu)
        ring_sm = ring_vjp(mesh, mechanism, layout)
        seq = [put(bf(order(a)), P(None, "x")) for a in (q, k, v)]
        c = put(bf(order(cot)), P(None, "x"))
        grad = jax.jit(lambda c, *a: jax.vjp(ring_sm, *a)[1](c))
        text = grad.lower(c, *seq).as_text()
        check("pk_ring_attention_bwd" in text and "collective_permute" not in text,
              f"n={n} ring backward ({mechanism}, {layout}) is one fused call")
        runs = [[mine(g) for g in grad(c, *seq)] for _ in range(3)]  # slots reused 3 times
        ref = reference(q, k, v, cot)
        for j, (name, r) in enumerate(zip(("dq", "dk", "dv"), ref)):
            idx, got = runs[-1][j]
            check(rel(got, order(np.asarray(r))[idx]) < 3e-2,
                  f"n={n} ring gradient {name} ({mechanism}, {layout})")
        for j, name in ((1, "dk"), (2, "dv")):
            check(all(np.array_equal(runs[0][j][1], run[j][1], equal_nan=False)
                      for run in runs[1:]),
                  f"n={n} {name} bitwise equal over 3 calls ({mechanism}, {layout})")
    pk_jax.check_errors()

    # The last rank never posts: its neighbours' waits give up (NaN), every
    # process raises, and the next call is right.
    (q, k, v), order, cot = ring_inputs(rng, n, "contiguous", bf, cpu)
    ring_sm = ring_vjp(mesh, "copy_engine", "contiguous")
    seq = [put(bf(a), P(None, "x")) for a in (q, k, v)]
    c = put(bf(cot), P(None, "x"))
    _, vjp_fn = jax.jit(lambda *a: jax.vjp(ring_sm, *a))(*seq)
    with pk_jax.configured(timeout_s=0.5), runtime.testing_skip_post(n - 1):
        bad = [mine(g)[1] for g in jax.jit(lambda f, c: f(c))(vjp_fn, c)]
    if me == 0:  # rank 0 waits for rank n - 1 (its prev) at its first step
        check(all(not np.isfinite(g).any() for g in bad),
              f"n={n} rank 0's gradients are NaN after a never-posting rank")
    try:
        pk_jax.check_errors()
        check(False, f"n={n} check_errors raises after a never-posting rank")
    except pk_jax.PkJaxTimeoutError as e:
        check(True, f"n={n} check_errors raises after a never-posting rank ({str(e)[:60]}...)")
    ref = reference(q, k, v, cot)
    for name, g, r in zip(("dq", "dk", "dv"), jax.jit(lambda f, c: f(c))(vjp_fn, c), ref):
        idx, got = mine(g)
        check(rel(got, np.asarray(r)[idx]) < 3e-2, f"n={n} after the reset {name} is right")
    pk_jax.check_errors()
    print("GPU_RING_BWD_DONE", flush=True)


if __name__ == "__main__":
    main()
