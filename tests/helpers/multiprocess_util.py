"""Plumbing of the multi-process GPU check scripts (gpu_multiprocess_check.py,
all_reduce_checks.py, gpu_ring_bwd_check.py), one process each, started by
`python -m pk_jax.launch -n N --gpus-per-process 0 SCRIPT`: one line per
check; for the 2-process scripts the 2-device mesh, inputs built from this
process's shard (no collective) and the timeout-then-recovery check every
op's failed wait must pass; the ring attention inputs and shard_map of the
ring-backward checks (any ring size)."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import runtime


def check(cond, what: str) -> None:
    """Print one line; exit non-zero on the first failure."""
    print(("OK " if cond else "FAILED ") + what, flush=True)
    if not cond:
        sys.exit(1)


def rel(a, b) -> float:
    """Relative error of a against b (float64 norms)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def local(out) -> tuple:
    """(index, data) of this process's shard of a result over the 2-device mesh."""
    shard, = out.addressable_shards
    return shard.index, np.asarray(shard.data)


def two_process_setup() -> tuple[Mesh, Callable, Callable]:
    """Join the job (GPU i where there are two or more, else both processes
    share GPU 0) and return (mesh ("x",) over the 2 devices, put(host array,
    spec): a global array from this process's shard, sm(fn, in_specs,
    out_specs): a jitted shard_map over the mesh)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # processes may share a GPU
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    me = int(os.environ["PK_JAX_PROCESS_ID"])
    pk_jax.distributed.initialize(local_device_ids=[me if gpus >= 2 else 0])
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())

    def put(a, spec):  # from this process's shard: no collective
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def sm(fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False))

    return mesh, put, sm


@contextlib.contextmanager
def peer_never_posts(what: str, names_op: Callable[[str], bool] | None = None):
    """The block runs with rank 1 skipping its posts and waits bounded at
    0.5 s (rank 0's waits give up); after it, check_errors must raise
    PkJaxTimeoutError on every process (`names_op(message)`: what the message
    must also satisfy). Run the call again afterwards: it must be right."""
    with pk_jax.configured(timeout_s=0.5), runtime.testing_skip_post(1):
        yield
    try:
        pk_jax.check_errors()
        check(False, f"{what}: check_errors raises on every process after a timeout")
    except pk_jax.PkJaxTimeoutError as e:
        check(names_op is None or names_op(str(e)),
              f"{what}: check_errors raises on every process after a timeout "
              f"({str(e)[:80]}...)")


def ring_inputs(rng, n: int, layout: str, bf: Callable, cpu) -> tuple:
    """((q, k, v), order, cot) for a ring of n ranks, 512 rows of sequence
    each: q, k, v bf16-representable float32 global arrays (`bf` rounds to
    bf16); order maps a global array to the order its contiguous shards take
    (zigzag reordered, on the host's `cpu`, with layout "zigzag"; else
    unchanged); cot a float32 cotangent."""
    s, hq, hkv, hd = n * 512, 8, 2, 128
    q, k, v, cot = (rng.standard_normal((1, s, h, hd)).astype(np.float32)
                    for h in (hq, hkv, hkv, hq))
    q, k, v = (np.asarray(bf(a), np.float32) for a in (q, k, v))

    def order(a):  # global array -> the order its contiguous shards take
        if layout != "zigzag":
            return a
        with jax.default_device(cpu):
            return np.asarray(pk_jax.zigzag_shard(jnp.asarray(a), n))
    return (q, k, v), order, cot


def ring_vjp(mesh: Mesh, mechanism: str, layout: str) -> Callable:
    """shard_map'd causal ring attention over "x" (sequence dim 1)."""
    return jax.shard_map(lambda q, k, v: pk_jax.ring_attention(
        q, k, v, "x", causal=True, layout=layout, mechanism=mechanism),
        mesh=mesh, in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"), check_vma=False)
