"""One process of a 2-process GPU job (tests/test_multiprocess_gpu.py starts it
through `python -m pk_jax.launch -n 2 --gpus-per-process 0`): every op across
processes against a float32 reference, then a timeout and its collective
recovery.

Each process drives one GPU: GPU i where there are two or more, else both
share GPU 0 (the workspaces then travel through CUDA IPC to the same GPU:
the export/import path and the cross-process protocol run, at time-sliced
speed). No XLA collective runs (NCCL refuses two ranks on one GPU): inputs
are built from their shards, gradients are vector-Jacobian products with a
sharded cotangent, references are computed on the host's CPU. Prints one
line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # processes may share a GPU
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import runtime  # noqa: E402
from pk_jax.ops.ring_attention.primitive import KERNEL_MECHANISMS as RING_MECHANISMS  # noqa: E402
from helpers.all_reduce_checks import run_multiprocess_checks  # noqa: E402
from helpers.fp8_refs import block_products  # noqa: E402
from helpers.multiprocess_util import (check, local, peer_never_posts, rel,  # noqa: E402
                                       ring_inputs, ring_vjp, two_process_setup)


def main() -> None:
    mesh, put, sm = two_process_setup()
    rng = np.random.default_rng(1234)  # the same global inputs on both processes
    cpu = jax.local_devices(backend="cpu")[0]  # this process's (devices("cpu") is global)

    # all_gather: every mechanism that works across processes, bit for bit.
    for mechanism, shape in (("auto", (2, 1024)), ("ld_st_ll", (2, 1024)),
                             ("copy_engine", (2, 1 << 20)), ("auto", (2, 1 << 20))):
        x = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        f = sm(lambda a, m=mechanism: pk_jax.all_gather(a, "x", tiled=True, mechanism=m),
               P("x"), P("x"))
        for _ in range(3):  # repeated calls: the epochs advance
            idx, got = local(f(put(x, P("x"))))
        check(np.array_equal(got, np.tile(x, (2, 1))[idx]),
              f"all_gather {mechanism} {shape} across processes, bit for bit")
    try:
        sm(lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_push"), P("x"), P("x")).lower(
            put(np.zeros((2, 4096), np.float32), P("x")))
        check(False, "a forced zero-copy all_gather across processes raises")
    except ValueError:
        check(True, "a forced zero-copy all_gather across processes raises")

    # Tensor-parallel MLP, forward and gradients.
    d, f_, m = 512, 1024, 512
    x = rng.standard_normal((2 * m, d)).astype(np.float32)
    w1 = (rng.standard_normal((d, f_)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((f_, d)) / np.sqrt(f_)).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)

    def mlp(x, w1, w2):
        h = pk_jax.all_gather_matmul(x, w1, "x", mechanism="chunked")
        return pk_jax.matmul_reduce_scatter(jnp.tanh(h), w2, "x", mechanism="chunked")
    specs = (P("x"), P(None, "x"), P("x", None))
    g = sm(mlp, specs, P("x"))
    args = [put(bf(a), s) for a, s in zip((x, w1, w2), specs)]
    xr, w1r, w2r = (np.asarray(bf(a), np.float32) for a in (x, w1, w2))
    idx, got = local(g(*args))
    check(rel(got.astype(np.float32), (np.tanh(xr @ w1r) @ w2r)[idx]) < 2e-2,
          "tensor-parallel MLP across processes")
    mlp_sm = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False)
    cot = rng.standard_normal((2 * m, d)).astype(np.float32)
    mlp_grad = jax.jit(lambda c, *a: jax.vjp(mlp_sm, *a)[1](c))
    text = mlp_grad.lower(put(bf(cot), P("x")), *args).as_text()
    check("@pk_all_gather_matmul_bwd(" in text and "@pk_matmul_reduce_scatter_bwd(" in text
          and "dot_general" not in text,
          "tensor-parallel MLP backward: one pk call per op computing dx and dw, no XLA dot")
    grads = mlp_grad(put(bf(cot), P("x")), *args)
    with jax.default_device(cpu):
        ref = jax.vjp(lambda *a: jnp.tanh(a[0] @ a[1]) @ a[2], xr, w1r, w2r)[1](cot)
    for name, gr, r in zip(("dx", "dw1", "dw2"), grads, ref):
        shard, = gr.addressable_shards
        check(rel(np.asarray(shard.data, np.float32), np.asarray(r)[shard.index]) < 3e-2,
              f"tensor-parallel MLP gradient {name} across processes")
    _tp_grads_timeout(mlp_sm, args, put(bf(cot), P("x")), ref)

    _matmul_all_reduce(mesh, put, cpu, rng, sm, bf)
    _fp8_mlp(mesh, put, cpu, rng, bf)
    _fp8_block_sequences(mesh, put, cpu, rng, bf)

    # Ring attention (both kernel mechanisms, both masks: the peers' blocks
    # are walked whole without one; head dims 128 and 256, whose 80-key tiles
    # repeat keys at a chunk's end), forward and gradients.
    for hd in (128, 256):
        s, hq, hkv = 2 * 512, 8, 2
        q, k, v = (rng.standard_normal((1, s, h, hd)).astype(np.float32) for h in (hq, hkv, hkv))
        qb, kb, vb = (np.asarray(bf(a), np.float32) for a in (q, k, v))
        seq = [put(bf(a), P(None, "x")) for a in (q, k, v)]  # placed once for all four calls
        for causal in (True, False):
            with jax.default_device(cpu):
                want = np.asarray(jax.nn.dot_product_attention(qb, kb, vb, is_causal=causal))
            for mechanism in RING_MECHANISMS:
                ring = sm(lambda q, k, v, m=mechanism, c=causal: pk_jax.ring_attention(
                    q, k, v, "x", causal=c, mechanism=m), (P(None, "x"),) * 3, P(None, "x"))
                idx, got = local(ring(*seq))
                mask = "causal" if causal else "full"
                check(rel(got.astype(np.float32), want[idx]) < 2e-2,
                      f"ring attention {mechanism} {mask} d{hd} across processes")
    # The fused backward moves K/V and dK/dV through pk's workspaces, so it
    # runs across processes on one shared GPU too (XLA's collectives do not).
    _ring_grads(mesh, put, cpu, rng, bf)
    _ring_grads_timeout(mesh, put, cpu, rng, bf)
    run_multiprocess_checks(mesh, put, sm, local, check, rng)  # all_reduce, reduce_scatter
    _moe(mesh, put, cpu, rng)
    _timeout_and_reset(mesh, put, sm, rng)
    _moe_timeout(mesh, put, sm, rng)
    _mispaired(put, sm, rng)
    print("GPU_MULTIPROCESS_DONE", flush=True)


def _fp8_mlp(mesh, put, cpu, rng, bf):
    """The tensor-parallel MLP with fp8= (every recipe the TP ops take):
    forward and gradients against float32 on the host, with the FP8
    tolerances of tests/test_fp8_cpu.py (two FP8 GEMMs deep: twice them)."""
    d, f_, m = 256, 512, 256
    x = rng.standard_normal((2 * m, d)).astype(np.float32)
    w1 = (rng.standard_normal((d, f_)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((f_, d)) / np.sqrt(f_)).astype(np.float32)
    cot = rng.standard_normal((2 * m, d)).astype(np.float32)
    specs = (P("x"), P(None, "x"), P("x", None))
    xr, w1r, w2r = (np.asarray(bf(a), np.float32) for a in (x, w1, w2))
    with jax.default_device(cpu):
        ref_fn = lambda *a: (a[0] @ a[1]) @ a[2]
        want = np.asarray(ref_fn(xr, w1r, w2r))
        ref = jax.vjp(ref_fn, xr, w1r, w2r)[1](cot)
    args = [put(bf(a), s) for a, s in zip((x, w1, w2), specs)]
    for recipe in ("current", "block"):
        def mlp(x, w1, w2, r=recipe):
            h = pk_jax.all_gather_matmul(x, w1, "x", fp8=r)
            return pk_jax.matmul_reduce_scatter(h, w2, "x", fp8=r)
        mlp_sm = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("x"),
                               check_vma=False)
        idx, got = local(jax.jit(mlp_sm)(*args))
        check(rel(got.astype(np.float32), want[idx]) < 0.12,
              f"FP8 ({recipe}) tensor-parallel MLP across processes")
        grads = jax.jit(lambda c, *a: jax.vjp(mlp_sm, *a)[1](c))(put(bf(cot), P("x")), *args)
        for name, gr, r in zip(("dx", "dw1", "dw2"), grads, ref):
            shard, = gr.addressable_shards
            check(rel(np.asarray(shard.data, np.float32), np.asarray(r)[shard.index]) < 0.2,
                  f"FP8 ({recipe}) tensor-parallel MLP gradient {name} across processes")
    pk_jax.check_errors()


def _ring_grads(mesh, put, cpu, rng, bf):
    """Gradients of ring attention (both forward mechanisms, both layouts;
    the backward is the fused pk_ring_attention_bwd call) against the
    float32 dense reference, with the tolerance of the gradient checks."""
    for mechanism, layout in (("copy_engine", "contiguous"), ("ld_st", "zigzag")):
        (q, k, v), order, cot = ring_inputs(rng, 2, layout, bf, cpu)
        ring_sm = ring_vjp(mesh, mechanism, layout)
        seq = [put(bf(order(a)), P(None, "x")) for a in (q, k, v)]
        grad = jax.jit(lambda c, *a: jax.vjp(ring_sm, *a)[1](c))
        c = put(bf(order(cot)), P(None, "x"))
        text = grad.lower(c, *seq).as_text()
        check("pk_ring_attention_bwd" in text and "collective_permute" not in text,
              f"ring attention backward ({mechanism}, {layout}) is one fused call, no XLA "
              "collective")
        for _ in range(3):  # repeated calls: the epochs advance, the region is reused
            grads = grad(c, *seq)
        with jax.default_device(cpu):
            ref = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True),
                          q, k, v)[1](cot)
        for name, gr, r in zip(("dq", "dk", "dv"), grads, ref):
            shard, = gr.addressable_shards
            check(rel(np.asarray(shard.data, np.float32), order(np.asarray(r))[shard.index])
                  < 3e-2, f"ring attention gradient {name} ({mechanism}, {layout}) across "
                  "processes")
    pk_jax.check_errors()


def _tp_grads_timeout(mlp_sm, args, c, ref):
    """The tensor-parallel MLP's fused backward with rank 1 never posting (the
    forward ran normally before): rank 0's waits give up and all its
    gradients are NaN (dw too: the dW GEMM ran, then the call was poisoned),
    check_errors raises on both processes naming a backward, and the next
    backward is right."""
    _, vjp_fn = jax.jit(lambda *a: jax.vjp(mlp_sm, *a))(*args)  # the forward, normally
    rank0 = int(os.environ["PK_JAX_PROCESS_ID"]) == 0
    with peer_never_posts("tensor-parallel MLP backward",
                          lambda msg: "(backward)" in msg if rank0 else True):
        bad = jax.jit(lambda f, c: f(c))(vjp_fn, c)
        bad = [np.asarray(g.addressable_shards[0].data, np.float32) for g in bad]
        if rank0:
            check(all(not np.isfinite(g).any() for g in bad),
                  "rank 0's MLP gradients (dx, dw1, dw2) are NaN after its backward wait "
                  "timed out")
    grads = jax.jit(lambda f, c: f(c))(vjp_fn, c)
    for name, gr, r in zip(("dx", "dw1", "dw2"), grads, ref):
        shard, = gr.addressable_shards
        check(rel(np.asarray(shard.data, np.float32), np.asarray(r)[shard.index]) < 3e-2,
              f"after the reset the tensor-parallel MLP gradient {name} is right")
    pk_jax.check_errors()


def _ring_grads_timeout(mesh, put, cpu, rng, bf):
    """The fused backward with rank 1 never posting (the forward ran
    normally before): rank 0's waits give up, its gradients are NaN,
    check_errors raises on both processes, and the next backward is right."""
    (q, k, v), order, cot = ring_inputs(rng, 2, "contiguous", bf, cpu)
    ring_sm = ring_vjp(mesh, "copy_engine", "contiguous")
    seq = [put(bf(a), P(None, "x")) for a in (q, k, v)]
    c = put(bf(cot), P(None, "x"))
    _, vjp_fn = jax.jit(lambda *a: jax.vjp(ring_sm, *a))(*seq)  # the forward, normally
    with pk_jax.configured(timeout_s=0.5), runtime.testing_skip_post(1):
        bad = jax.jit(lambda f, c: f(c))(vjp_fn, c)
        bad = [np.asarray(g.addressable_shards[0].data, np.float32) for g in bad]
    rank0 = int(os.environ["PK_JAX_PROCESS_ID"]) == 0
    if rank0:
        check(all(not np.isfinite(g).any() for g in bad),
              "rank 0's gradients are NaN after its fused-backward wait timed out")
    try:
        pk_jax.check_errors()
        check(False, "check_errors raises on both processes after a fused-backward timeout")
    except pk_jax.PkJaxTimeoutError as e:
        # Rank 0 names the op that waited; rank 1 that process 0 failed.
        check(("ring_attention_bwd" in str(e)) if rank0 else True,
              f"check_errors raises on both processes after a fused-backward timeout "
              f"({str(e)[:80]}...)")
    grads = jax.jit(lambda f, c: f(c))(vjp_fn, c)
    with jax.default_device(cpu):
        ref = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True),
                      q, k, v)[1](cot)
    for name, gr, r in zip(("dq", "dk", "dv"), grads, ref):
        shard, = gr.addressable_shards
        check(rel(np.asarray(shard.data, np.float32), np.asarray(r)[shard.index]) < 3e-2,
              f"after the reset the fused backward's {name} is right")


def _fp8_block_sequences(mesh, put, cpu, rng, bf):
    """Each TP op with fp8="block" across the processes runs its FP8 host
    sequence with block factors (all_gather_matmul's rows travel to the
    peer with their factors; the row chunks of matmul_reduce_scatter,
    chunked matmul_all_reduce and all_gather_matmul's dx read theirs):
    `_fp8_block_case` each."""
    ar = (P(None, "x"), P("x", None))
    cases = (  # name, op, in_specs, out_spec, x shape, w shape, its sequences
        ("all_gather_matmul", pk_jax.all_gather_matmul, (P("x"), P(None, "x")), P(None, "x"),
         (2 * 256, 512), (512, 2 * 384), ("all_gather_matmul", "matmul_reduce_scatter")),
        ("matmul_reduce_scatter", pk_jax.matmul_reduce_scatter, ar, P("x"), (2 * 256, 2 * 256),
         (2 * 256, 768), ("matmul_reduce_scatter", "all_gather_matmul")),
        ("matmul_all_reduce chunked", pk_jax.matmul_all_reduce, ar, P(), (1024, 2 * 256),
         (2 * 256, 768), ("matmul_all_reduce",)),
        ("matmul_all_reduce one_shot", pk_jax.matmul_all_reduce, ar, P(), (128, 2 * 256),
         (2 * 256, 768), ("matmul_all_reduce",)))
    for case in cases:
        _fp8_block_case(mesh, put, cpu, rng, bf, *case)
    pk_jax.check_errors()


def _fp8_block_case(mesh, put, cpu, rng, bf, name, fn, in_specs, out_spec, xshape, wshape,
                    sequences):
    """One op with fp8="block": the forward and dx run `sequences`; forward
    and gradients (twice: the epochs advance) against the float32 products
    of the dequantized operands (tests/helpers/fp8_refs.py) within bfloat16
    rounding; matmul_all_reduce's result the same bits on both processes."""
    x = rng.standard_normal(xshape).astype(np.float32)
    w = (rng.standard_normal(wshape) / np.sqrt(wshape[0])).astype(np.float32)
    cot = rng.standard_normal((xshape[0], wshape[1])).astype(np.float32)
    with jax.default_device(cpu):
        refs = block_products(*(np.asarray(bf(a), np.float32) for a in (x, w, cot)))
    # checked types: psum's transpose (matmul_all_reduce) gives every rank the whole dy
    f = jax.shard_map(lambda a, b: fn(a, b, "x", fp8="block"), mesh=mesh, in_specs=in_specs,
                      out_specs=out_spec)
    args = [put(bf(a), s) for a, s in zip((x, w), in_specs)]
    c = put(bf(cot), out_spec)
    vjp = jax.jit(lambda c, *a: jax.vjp(f, *a)[1](c))
    text = jax.jit(f).lower(*args).as_text() + vjp.lower(c, *args).as_text()
    check(all(f"@pk_{s}_fp8(" in text for s in sequences),
          f"FP8 (block) {name}: forward and dx run the host sequences")
    for _ in range(2):  # repeated calls: the epochs advance
        outs = (jax.jit(f)(*args), *vjp(c, *args))
    for what, out, ref in zip(("y", "dx", "dw"), outs, refs):
        shard, = out.addressable_shards
        check(rel(np.asarray(shard.data, np.float32), ref[shard.index]) < 1e-2,
              f"FP8 (block) {name} {what} across processes, against the dequantized "
              "operands' product")
    if fn is pk_jax.matmul_all_reduce:
        both = jax.shard_map(lambda a, b: pk_jax.all_gather(fn(a, b, "x", fp8="block")[None],
                                                            "x", tiled=True),
                             mesh=mesh, in_specs=in_specs, out_specs=P("x"), check_vma=False)
        _, got = local(jax.jit(both)(*args))  # both ranks' copies
        check(np.array_equal(got[0].view(np.uint16), got[1].view(np.uint16)),
              f"FP8 (block) {name}: both ranks hold the same bits")


def _matmul_all_reduce(mesh, put, cpu, rng, sm, bf):
    """psum(x @ w) across processes, both mechanisms: the same bits on both
    ranks (compared through pk's own all_gather), close to the fp32 product;
    gradients against the fp32 vector-Jacobian product."""
    # chunked at 4096 rows: 2048 per rank, pushed in two pieces
    for mechanism, m in (("chunked", 1024), ("chunked", 4096), ("one_shot", 64),
                         ("auto", 128)):
        k, n_cols = 512, 768
        x = rng.standard_normal((m, 2 * k)).astype(np.float32)
        w = (rng.standard_normal((2 * k, n_cols)) / np.sqrt(2 * k)).astype(np.float32)
        xr, wr = (np.asarray(bf(a), np.float32) for a in (x, w))
        args = (put(bf(x), P(None, "x")), put(bf(w), P("x", None)))

        def both(a, b, mech=mechanism):  # every rank's copy of the result
            y = pk_jax.matmul_all_reduce(a, b, "x", mechanism=mech)
            return pk_jax.all_gather(y[None], "x", tiled=True)
        for _ in range(3):  # repeated calls: the epochs advance
            _, got = local(sm(both, (P(None, "x"), P("x", None)), P("x"))(*args))
        got = np.asarray(got)  # [2 (one per rank) * 1, m, n_cols] on this process's shard
        got = got.reshape(2, m, n_cols)
        check(np.array_equal(got[0].view(np.uint16), got[1].view(np.uint16)),
              f"matmul_all_reduce {mechanism} M={m}: both ranks hold the same bits")
        check(rel(got[0].astype(np.float32), xr @ wr) < 1e-2,
              f"matmul_all_reduce {mechanism} M={m} across processes")
    f = jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", mechanism="chunked"),
                      mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P())
    cot = rng.standard_normal((m, n_cols)).astype(np.float32)
    grads = jax.jit(lambda c, *a: jax.vjp(f, *a)[1](c))(put(bf(cot), P()), *args)
    with jax.default_device(cpu):
        ref = jax.vjp(lambda a, b: a @ b, xr, wr)[1](cot)
    for name, gr, r in zip(("dx", "dw"), grads, ref):
        shard, = gr.addressable_shards
        check(rel(np.asarray(shard.data, np.float32), np.asarray(r)[shard.index]) < 3e-2,
              f"matmul_all_reduce gradient {name} across processes")


def _moe(mesh, put, cpu, rng):
    """moe_dispatch / moe_combine with pk's exchange kernel (mechanism "ld_st":
    the count table through pk's all_gather, rows through the staging
    regions; no XLA collective), values and gradients against the dense
    reference, drop-less and with a capacity."""
    t, h, e, k = 64, 128, 8, 2
    x = rng.standard_normal((2 * t, h)).astype(np.float32)
    ids = np.stack([rng.choice(5, k, replace=False) for _ in range(2 * t)]).astype(np.int32)
    w = rng.random((2 * t, k)).astype(np.float32)
    wts = (rng.standard_normal((e, h, h)) / np.sqrt(h)).astype(np.float32)
    cot = rng.standard_normal((2 * t, h)).astype(np.float32)
    for capacity in (None, 24):
        def layer(x, ids, w, wts, capacity=capacity):
            rows, lay = pk_jax.moe_dispatch(x, ids, "x", num_experts=e, capacity=capacity,
                                            mechanism="ld_st")
            y = jax.lax.ragged_dot(rows, wts, lay.group_sizes,
                                   precision=jax.lax.Precision.HIGHEST)
            return pk_jax.moe_combine(y, w, lay), lay.num_dropped[None]
        f = jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 4,
                          out_specs=(P("x"), P("x")), check_vma=False)
        args = [put(a, P("x")) for a in (x, ids, w, wts)]
        for _ in range(3):  # repeated calls: the epochs advance
            out, dropped = jax.jit(f)(*args)
        # Which slots the experts keep: first `capacity` in (source rank, slot) order.
        keep = np.ones_like(ids, bool)
        if capacity is not None:
            seen = np.zeros(e, int)
            for i, ex in enumerate(ids.reshape(-1)):
                keep.reshape(-1)[i] = seen[ex] < capacity
                seen[ex] += 1
        with jax.default_device(cpu):
            dense = lambda x, w: jnp.einsum("tk,tkf->tf", jnp.where(keep, w, 0), jnp.einsum(
                "th,tkhf->tkf", x, wts[ids], precision="highest"), precision="highest")
            want = np.asarray(dense(x, w))
            ref_dx, ref_dw = jax.vjp(dense, x, w)[1](cot)
        idx, got = local(out)
        check(rel(got, want[idx]) < 1e-4, f"moe dispatch+combine ld_st capacity={capacity} "
                                          "across processes")
        (sl,), dr = local(dropped)
        rank = sl.start or 0
        check(int(dr.sum()) == int(np.sum(~keep[rank * t:(rank + 1) * t])),
              f"moe drop count capacity={capacity}")
        vjp = lambda c, a, i, b, ws: jax.vjp(lambda a, b: f(a, i, b, ws)[0], a, b)[1](c)
        grads = jax.jit(vjp)(put(cot, P("x")), *args)
        for name, gr, r in zip(("dx", "dweights"), grads, (ref_dx, ref_dw)):
            i, gl = local(gr)
            check(rel(gl, np.asarray(r)[i]) < 1e-4,
                  f"moe gradient {name} capacity={capacity} across processes")


def _timeout_and_reset(mesh, put, sm, rng):
    pk_jax.check_errors()
    check(True, "no failed wait so far")

    # A peer that never posts: rank 0's wait gives up; check_errors raises on
    # both processes; afterwards calls are right again.
    x = rng.integers(0, 2**32, size=(2, 1 << 16), dtype=np.uint32)
    gather = lambda: sm(lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="copy_engine"),
                        P("x"), P("x"))
    with peer_never_posts("all_gather copy_engine"):
        gather()(put(x, P("x"))).block_until_ready()
    idx, got = local(gather()(put(x, P("x"))))
    check(np.array_equal(got, np.tile(x, (2, 1))[idx]),
          "after the collective reset the next gather is right")
    pk_jax.check_errors()


def _moe_timeout(mesh, put, sm, rng):
    """Rank 1 never posts: rank 0's bounded waits give up, its MoE output is
    poison (NaN), check_errors raises on both processes; then it works again."""
    x = rng.standard_normal((128, 64)).astype(np.float32)
    ids = rng.integers(0, 4, size=(128, 2)).astype(np.int32)

    def layer(x, ids):
        rows, lay = pk_jax.moe_dispatch(x, ids, "x", num_experts=4, mechanism="ld_st")
        return pk_jax.moe_combine(rows, jnp.ones(ids.shape, x.dtype), lay)
    args = (put(x, P("x")), put(ids, P("x")))
    with peer_never_posts("moe ld_st"):
        idx, got = local(sm(layer, (P("x"), P("x")), P("x"))(*args))
        if (idx[0].start or 0) == 0:
            check(bool(np.isnan(got).all()), "moe ld_st: the waiting rank's output is poison")
    idx, got = local(sm(layer, (P("x"), P("x")), P("x"))(*args))
    check(rel(got, (2 * x)[idx]) < 1e-6, "moe ld_st right again after the reset")
    pk_jax.check_errors()


def _crossed(op):
    """Rank 0 calls op on a, then on b; rank 1 on b, then a: two programs
    sharing the op's channel in different orders, so each call pairs the
    two layouts. Returns (op(a), op(b)) on each rank."""
    def a_first(a, b, *extra):
        oa = op(a, *extra)
        oa, b = lax.optimization_barrier((oa, b))
        return oa, op(b, *extra)

    def b_first(a, b, *extra):
        ob = op(b, *extra)
        ob, a = lax.optimization_barrier((ob, a))
        return op(a, *extra), ob
    return lambda a, b, *extra: lax.cond(lax.axis_index("x") == 0, a_first, b_first, a, b,
                                         *extra)


def _is_poison(a) -> bool:
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
        return bool(np.isnan(np.asarray(a, np.float32)).all())
    return bool((a.view(np.uint8) == 0xFF).all())


def _moe_layer(x):
    """Dispatch and combine (pk's exchange) with two identity experts per
    token, weights 1: 2 x; the experts from x's first two columns."""
    ids = (jnp.abs(x[:, :2]) * 1000).astype(jnp.int32) % 4
    rows, lay = pk_jax.moe_dispatch(x, ids, "x", num_experts=4, mechanism="ld_st")
    return pk_jax.moe_combine(rows, jnp.ones(ids.shape, x.dtype), lay)


def _mispaired(put, sm, rng):
    """Each staged path with mispaired calls (`_crossed`): every wait that
    consumes a peer's block finds the peer's post carrying another layout
    (kErrLayout; or a rank's slot was overwritten by the peer's next call,
    kErrClobbered), so both calls' outputs are poison on both ranks,
    check_errors raises on both processes naming the cause, and the op is
    right again afterwards (against a host reference)."""
    bf = lambda *shape: np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    ints = lambda *shape: rng.integers(0, 2**32, size=shape, dtype=np.uint32)
    f32 = lambda a: np.asarray(a, np.float32)
    w_col, w_row = bf(256, 2 * 128), bf(2 * 256, 128)
    cases = [  # name, op(x, *extra), a, b, extra, in_specs (x, *extra), out_spec, ref(a)
        ("all_gather copy_engine",
         lambda a: pk_jax.all_gather(a, "x", tiled=True, mechanism="copy_engine"),
         ints(2, 4096), ints(2, 8192), (), (P("x"),), P("x"), lambda a: np.tile(a, (2, 1))),
        ("all_reduce two_shot", lambda a: pk_jax.all_reduce(a, "x", mechanism="two_shot"),
         bf(2, 8192), bf(2, 16384), (), (P("x"),), P("x"),
         lambda a: np.tile(f32(a).sum(0, keepdims=True), (2, 1))),
        ("reduce_scatter two_shot",
         lambda a: pk_jax.reduce_scatter(a, "x", scatter_dimension=1, tiled=True,
                                         mechanism="two_shot"),
         bf(2, 8192), bf(2, 16384), (), (P("x"),), P("x"),
         lambda a: f32(a).sum(0).reshape(2, -1)),
        ("all_gather_matmul", lambda a, w: pk_jax.all_gather_matmul(a, w, "x"),
         bf(2 * 128, 256), bf(2 * 256, 256), (w_col,), (P("x"), P(None, "x")), P(None, "x"),
         lambda a: f32(a) @ f32(w_col)),
        ("matmul_reduce_scatter", lambda a, w: pk_jax.matmul_reduce_scatter(a, w, "x"),
         bf(2 * 128, 512), bf(2 * 256, 512), (w_row,), (P(None, "x"), P("x", None)), P("x"),
         lambda a: f32(a) @ f32(w_row)),
        ("matmul_all_reduce chunked",
         lambda a, w: pk_jax.matmul_all_reduce(a, w, "x", mechanism="chunked"),
         bf(512, 512), bf(1024, 512), (w_row,), (P(None, "x"), P("x", None)), P(),
         lambda a: f32(a) @ f32(w_row)),
        ("moe ld_st", _moe_layer, rng.standard_normal((2 * 64, 64)).astype(np.float32),
         rng.standard_normal((2 * 128, 64)).astype(np.float32), (), (P("x"),), P("x"),
         lambda a: 2 * a),
    ]
    # The first failure a rank records: its wait found the peer's other layout,
    # or (the peer ran ahead into its next call, whose credit wait gave up at
    # once after the peer's own failure) its slot was overwritten while it
    # read it.
    staged = (("layout", "overwrote"), None)
    for case in cases:
        _check_mispaired(put, sm, *case, *staged)
    # Ring attention's stamps carry no layout: calls of two K/V layouts use
    # two channels (the layout is in the channel's key), so each layout's
    # calls pair only with each other. Crossed, the first calls wait on each
    # other (rank 0's a for rank 1's a, which follows rank 1's b, which waits
    # for rank 0's b, which follows rank 0's a) until one times out; a call
    # that then finds its own layout's post computes the right answer. So
    # every output is poison or right, never the other layout's blocks, and
    # a rank whose own waits all succeeded hears of its peer's failure.
    ring = lambda a: pk_jax.ring_attention(a, a, a, "x")
    _check_mispaired(put, sm, "ring_attention", ring, bf(1, 2 * 256, 2, 128),
                     bf(1, 2 * 512, 2, 128), (), (P(None, "x"),), P(None, "x"), _attention,
                     ("timed out", "recorded failed waits"), 0.5, poison_or_right=True)


def _check_mispaired(put, sm, name, op, a, b, extra, in_specs, out_spec, ref, causes,
                     timeout_s, poison_or_right=False):
    """`_crossed(op)` on a and b (lowered with `timeout_s` where given): both
    outputs poison on this rank (`poison_or_right`: each poison or equal to
    its reference), check_errors raising with one of `causes`; then op(a)
    against ref(a) after the reset."""
    x_spec = in_specs[0]
    specs = (x_spec, x_spec, *in_specs[1:])
    args = [put(v, s) for v, s in zip((a, b, *extra), specs)]
    with pk_jax.configured(timeout_s=timeout_s) if timeout_s else contextlib.nullcontext():
        outs = sm(_crossed(op), specs, (out_spec, out_spec))(*args)
    shards = [local(o) for o in outs]
    poison = [_is_poison(g) for _, g in shards]
    if poison_or_right:
        right = [rel(np.asarray(g, np.float32), ref(x)[idx]) < 2e-2
                 for (idx, g), x in zip(shards, (a, b))]
        check(all(p or r for p, r in zip(poison, right)),
              f"{name}: each mispaired call's output is poison or right on this rank, "
              f"never mixed ({sum(poison)} poison)")
    else:
        check(all(poison), f"{name}: both mispaired calls' outputs are poison on this rank")
    try:
        pk_jax.check_errors()
        check(False, f"{name}: check_errors raises after mispaired calls")
    except pk_jax.PkJaxTimeoutError as e:
        check(any(c in str(e) for c in causes),
              f"{name}: check_errors names the mispairing ({str(e)[:90]}...)")
        # layouts read as sizes (the MoE combine's direction flag as a word)
        check(not re.search(r"\d{13,}", str(e)), f"{name}: the message's layouts are sizes")
    idx, got = local(sm(op, in_specs, out_spec)(args[0], *args[2:]))
    check(rel(np.asarray(got, np.float32), ref(a)[idx]) < 2e-2,
          f"{name}: right again after the reset")
    pk_jax.check_errors()


def _attention(a):
    """Full attention with q = k = v = a [B, S, H, D], float32 (numpy)."""
    a = np.asarray(a, np.float32)
    s = np.einsum("bqhd,bkhd->bhqk", a, a) / np.sqrt(a.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), a)

if __name__ == "__main__":
    main()
