"""Ring attention (sequence parallel over every visible GPU, mesh axis "sp"):
pk_jax.ring_attention against baselines measured in the same run.

Implementations, bf16, global sequence S split over n = device count:
  * pk: `pk_jax.ring_attention` inside shard_map (`--mechanism`, default
    "auto"; or `--mechanisms copy_engine,ld_st,ld_st:8` to time several in one
    run, rows pk_<layout>_<mechanism>, "ld_st:C" forcing C communicator CTAs,
    row suffix ld_stC). Non-causal: layout "contiguous"; causal: layout
    "zigzag" (inputs reordered with `pk_jax.zigzag_shard` before sharding) and
    "contiguous".
  * cudnn_ring: the Transformer Engine approach. A ppermute ring inside
    shard_map; each step runs cuDNN flash attention on the visiting K/V block
    and merges with the log-sum-exp. Causal zigzag follows TE's recipe (step
    0: the local block causal; later steps: a block from an earlier rank is
    seen by all our queries through its first half only, a block from a later
    rank only by our second half, both without mask); causal contiguous skips
    the blocks of later ranks. Its backward (`--backward`) is a custom VJP: a
    second ring of cuDNN backward calls fed the global output and
    log-sum-exp, dK/dV travelling with their block and sent home at the end.
  * einsum_ring: a ppermute ring with plain einsum + fp32 softmax, i.e.
    `pk_jax.ring_attention(..., mechanism="xla")` (forward only, up to
    `--einsum-max-seq`: it materializes S_local^2 scores per head).
  * ideal: cuDNN on one GPU with the same per-GPU work and no communication
    (non-causal: S/n queries against S keys; causal: the whole-sequence
    causal call's time divided by n).
  * world size 1: pk on a 1-GPU mesh against one-GPU cuDNN (`--ws1-seq`).

Per-GPU TFLOP/s: non-causal forward 4*B*(S/n)*S*Hq*D; causal counts only
the unmasked half; forward+backward counts 3.5x the forward (backward as 2.5x,
as in ../shared/notes/baselines-h200.md).

Correctness guard before any timing: every output is checked on sampled query
rows against an fp32 reference of the whole sequence, and pk's output against
the cuDNN ring's on the same inputs (whole output); with `--backward` the
gradients of a weighted sum of the output are checked against one-GPU
attention on the whole sequence. An implementation outside bf16 tolerance is
marked FAILED and not timed: the speed of a wrong answer is not reported.

cuDNN block attention: the log-sum-exp comes from jax's cuDNN wrapper with
return_residual=True (fp32 from `jax._src.cudnn.fused_attention_stablehlo`
where available; the public `jax.nn.dot_product_attention` rounds it to the
input dtype). The backward ring binds jax's cuDNN backward primitive with
the global statistics; its operand list is read from the installed jax and
checked at start-up on a small case against an fp32 einsum (a mismatch skips
the cuDNN rows with the reason). Without CUDA GPUs the cuDNN and ideal rows
are skipped with a printed reason; `--emulate-cudnn` puts fp32 einsum blocks
in cuDNN's place to check the ring logic on CPU.

Usage:
  python benchmarks/ring_attention.py [--seqs 16384,32768,65536] [--backward]
  CPU smoke test:  python benchmarks/ring_attention.py --cpu-devices 8 \\
      --seqs 256 --heads 2 --ws1-seq 128 --no-save [--emulate-cudnn] [--backward]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.ops.ring_attention_primitive import region_bytes
from common import markdown_table, one_axis_mesh, time_ms, write_results

AXIS = "sp"
SEQ = P(None, AXIS)
NEG = -1e30  # log-sum-exp of an empty block: merges as weight 0, never NaN
F32 = jnp.float32
HI = lax.Precision.HIGHEST  # fp32 references: no TF32 on GPUs
# bf16 tolerances: relative L2 error of the whole compared tensor, and the
# worst single row (token) relative error. bf16 rounding alone gives ~0.3%.
TOL_L2, TOL_ROW = 2e-2, 5e-2
TOL_GRAD_L2, TOL_GRAD_ROW = 3e-2, 1e-1
BWD_FLOP_FACTOR = 3.5  # forward + backward, backward counted as 2.5x forward

HEADER = ["n", "S", "mask", "pass", "impl", "ms", "TFLOP/s/GPU", "of ideal", "vs cuDNN ring"]


class Unavailable(Exception):
    """A baseline cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Dims:
    """Problem dimensions other than the sequence."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


# ---- block attention: fp32 einsum (CPU checks) and cuDNN ------------------------
class Blocks(NamedTuple):
    """One attention block and its backward with given global statistics.

    fwd(q, k, v, causal, scale) -> (out [B,T,Hq,D] in q's dtype, lse [B,Hq,T] f32)
    bwd(q, k, v, out, lse, dout, causal, scale) -> (dq, dk, dv) in input dtypes,
        the block's share of the gradient when `out` / `lse` are the final
        (all-block) output and log-sum-exp of these query rows; None when
        unavailable (then `bwd_note` says why).
    whole(q, k, v, causal, scale) -> out: differentiable attention on one device
        (the ideal and the gradient reference).
    """

    name: str
    fwd: Callable
    bwd: Callable | None
    whole: Callable
    note: str
    bwd_note: str = ""


def _grouped_scores(q, k, causal: bool, scale: float):
    """fp32 scores [B, Hkv, G, T, S] (query head h uses kv head h // G) and
    the causal mask (top-left aligned) or None."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q5 = q.astype(F32).reshape(b, t, hk, hq // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q5, k.astype(F32), precision=HI) * scale
    mask = (jnp.arange(t)[:, None] >= jnp.arange(k.shape[1])[None, :]) if causal else None
    return q5, s, mask


def einsum_fwd(q, k, v, causal: bool, scale: float):
    """Reference block attention in fp32 (same contract as cuDNN's)."""
    b, t, hq, d = q.shape
    _, s, mask = _grouped_scores(q, k, causal, scale)
    if mask is not None:
        s = jnp.where(mask, s, NEG)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32), precision=HI).reshape(b, t, hq, d)
    return o.astype(q.dtype), lse.reshape(b, hq, t)


def einsum_bwd(q, k, v, out, lse, dout, causal: bool, scale: float):
    """Block backward in fp32 with the given (global) output and log-sum-exp."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q5, s, mask = _grouped_scores(q, k, causal, scale)
    p = jnp.exp(s - lse.reshape(b, hk, hq // hk, t)[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    do5 = dout.astype(F32).reshape(q5.shape)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do5, out.astype(F32).reshape(q5.shape),
                       precision=HI)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do5, precision=HI)
    ds = p * (jnp.einsum("btkgd,bskd->bkgts", do5, v.astype(F32), precision=HI) - delta[..., None])
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32), precision=HI).reshape(q.shape) * scale
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q5, precision=HI) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def einsum_blocks() -> Blocks:
    """fp32 einsum blocks standing in for cuDNN (`--emulate-cudnn`)."""
    whole = lambda q, k, v, causal, scale: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="xla")
    return Blocks("einsum (emulating cuDNN)", einsum_fwd, einsum_bwd, whole,
                  "fp32 einsum blocks in place of cuDNN")


def cudnn_blocks() -> Blocks:
    """cuDNN flash attention blocks; raises Unavailable with the reason."""
    devs = jax.devices()
    if devs[0].platform != "gpu":
        raise Unavailable(f"no CUDA GPU (platform {devs[0].platform}): cuDNN attention needs one")
    notes = []

    def whole(q, k, v, causal, scale):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            implementation="cudnn")

    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        fa = None
    if fa is not None and "return_residual" in inspect.signature(fa.dot_product_attention).parameters:
        def fwd(q, k, v, causal, scale):
            mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
            out, stats = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask,
                                                  qkv_layout="BTNH", return_residual=True)
            return out, stats.astype(F32)  # [B, Hq, T], fp32 already
        notes.append("lse: fp32 from jax._src.cudnn (return_residual)")
    elif "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters:
        def fwd(q, k, v, causal, scale):
            out, res = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                    implementation="cudnn", return_residual=True)
            return out, jnp.swapaxes(res, 1, 2).astype(F32)  # [B, T, H] -> [B, H, T]
        notes.append("lse: jax.nn return_residual (rounded to the input dtype)")
    else:
        def fwd(q, k, v, causal, scale):
            out = whole(q, k, v, causal, scale)
            _, s, mask = _grouped_scores(q, k, causal, scale)
            lse = jax.nn.logsumexp(jnp.where(mask, s, NEG) if causal else s, axis=-1)
            return out, lse.reshape(q.shape[0], q.shape[2], q.shape[1])
        notes.append("lse: this jax has no return_residual; computed by an fp32 einsum "
                     "(correct, but slows the cuDNN ring)")
    bwd, bwd_note = None, ""
    try:
        bwd = _cudnn_bwd(fa)
    except Unavailable as e:
        bwd_note = str(e)
    blocks = Blocks("cudnn", fwd, bwd, whole, "; ".join(notes), bwd_note)
    return _probe(blocks)


# Operands of jax's cuDNN backward primitive that the ring leaves empty.
_UNUSED_OPERANDS = {"bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
                    "page_table_v"}


def _cudnn_bwd(fa) -> Callable:
    """cuDNN flash-attention backward fed given statistics (what a ring's
    backward needs: jax's custom VJP would use the block's own). The operand
    and attribute names are read from the installed jax; unknown ones raise."""
    if fa is None or not hasattr(fa, "_dot_product_attention_bwd_p_wrapper"):
        raise Unavailable("jax has no cuDNN backward primitive to bind")
    names = list(inspect.signature(fa._dot_product_attention_bwd_impl).parameters)
    if "scale" not in names:
        raise Unavailable(f"unknown cuDNN backward signature {names}")
    operands, attrs = names[:names.index("scale")], names[names.index("scale"):]
    unknown = set(operands) - _UNUSED_OPERANDS - {"query", "key", "value", "activation",
                                                  "fwd_output", "grad_output"}
    known_attrs = {"scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                   "sliding_window_length"}
    if unknown or set(attrs) - known_attrs:
        raise Unavailable(f"unknown cuDNN backward operands/attributes "
                          f"{sorted(unknown | (set(attrs) - known_attrs))}")

    def bwd(q, k, v, out, lse, dout, causal, scale):
        empty = jnp.zeros(0, q.dtype)
        given = {"query": q, "key": k, "value": v, "activation": lse.astype(F32),
                 "fwd_output": out.astype(q.dtype), "grad_output": dout.astype(q.dtype)}
        values = dict(scale=float(scale), seed=42, dropout_rate=0.0, variadic_args=(False, False),
                      mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK,
                      layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
        grads = fa._dot_product_attention_bwd_p_wrapper.bind(
            *(given.get(nm, empty) for nm in operands), **{a: values[a] for a in attrs})
        return grads[0], grads[1], grads[2]
    return bwd


def _probe(blocks: Blocks) -> Blocks:
    """Check the cuDNN blocks against fp32 einsum on small cases (GQA, T != S,
    causal) on one GPU; raise Unavailable, or drop the backward, on mismatch."""
    key = jax.random.split(jax.random.key(0), 4)
    dev = jax.devices()[0]
    bwd, bwd_note = blocks.bwd, blocks.bwd_note
    for causal, t, s in ((False, 128, 256), (True, 256, 256)):
        q = jax.device_put(jax.random.normal(key[0], (2, t, 4, 128), jnp.bfloat16), dev)
        k, v = (jax.device_put(jax.random.normal(kk, (2, s, 2, 128), jnp.bfloat16), dev)
                for kk in key[1:3])
        do = jax.device_put(jax.random.normal(key[3], q.shape, jnp.bfloat16), dev)
        scale = 128 ** -0.5
        try:
            out, lse = jax.jit(blocks.fwd, static_argnums=(3, 4))(q, k, v, causal, scale)
        except Exception as e:  # noqa: BLE001 - any failure means: no cuDNN here
            raise Unavailable(f"cuDNN block attention failed: {_first_line(e)}") from e
        ref_out, ref_lse = einsum_fwd(q, k, v, causal, scale)
        l2, _ = _errors(out, ref_out)
        lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
        if not (l2 <= TOL_L2 and lse_err <= 0.05):
            raise Unavailable(f"cuDNN block attention disagrees with fp32 einsum (causal={causal}, "
                              f"T={t}, S={s}): output rel err {l2:.3g}, lse max err {lse_err:.3g}")
        if bwd is None:
            continue
        try:
            got = jax.jit(bwd, static_argnums=(6, 7))(q, k, v, ref_out, ref_lse, do, causal, scale)
        except Exception as e:  # noqa: BLE001
            bwd, bwd_note = None, f"cuDNN backward with given statistics failed: {_first_line(e)}"
            continue
        want = einsum_bwd(q, k, v, ref_out, ref_lse, do, causal, scale)
        errs = [_errors(a, b)[0] for a, b in zip(got, want)]
        if not max(errs) <= TOL_GRAD_L2:
            bwd, bwd_note = None, (f"cuDNN backward with given statistics disagrees with fp32 "
                                   f"einsum (causal={causal}): dq/dk/dv rel err {errs}")
    return blocks._replace(bwd=bwd, bwd_note=bwd_note)


# ---- the cuDNN ring (Transformer Engine style) ---------------------------------
def _lse_to_bthd(lse):
    """[B, H, T] -> [B, T, H, 1], to weight outputs [B, T, H, D]."""
    return jnp.transpose(lse, (0, 2, 1))[..., None]


def _merge(state, out, lse):
    """Merge one block's (output, lse) into the running (fp32 output, lse)."""
    acc, m = state
    new = jnp.logaddexp(m, lse)
    acc = acc * jnp.exp(_lse_to_bthd(m - new)) + out.astype(F32) * jnp.exp(_lse_to_bthd(lse - new))
    return acc, new


def _merge_second_half(state, out, lse, c):
    """Merge a block that only the second half of our queries (rows c:) sees."""
    acc, m = state
    a2, m2 = _merge((acc[:, c:], m[..., c:]), out, lse)
    return acc.at[:, c:].set(a2), m.at[..., c:].set(m2)


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Static description of one ring."""

    n: int
    causal: bool
    layout: str  # "contiguous" | "zigzag"
    scale: float


def _ring_forward(q, k, v, spec: RingSpec, blocks: Blocks):
    """Forward ring of cuDNN blocks; returns (out in q's dtype, lse [B,H,T] f32)."""
    n, fwd = spec.n, blocks.fwd
    rank = lax.axis_index(AXIS)
    perm = [(i, (i + 1) % n) for i in range(n)]
    c = q.shape[1] // 2
    out, lse = fwd(q, k, v, spec.causal, spec.scale)  # step 0: our own block
    state = (out.astype(F32), lse)
    kb, vb = k, v
    for step in range(1, n):
        kb, vb = lax.ppermute(kb, AXIS, perm), lax.ppermute(vb, AXIS, perm)
        src = (rank - step) % n  # the rank whose block is visiting
        if not spec.causal:
            state = _merge(state, *fwd(q, kb, vb, False, spec.scale))
        elif spec.layout == "contiguous":  # earlier ranks: all visible; later: all masked
            state = lax.cond(src < rank,
                             lambda st, kb=kb, vb=vb: _merge(st, *fwd(q, kb, vb, False, spec.scale)),
                             lambda st: st, state)
        else:  # zigzag: ours = chunks (rank, 2n-1-rank), visiting = (src, 2n-1-src)
            state = lax.cond(
                src < rank,
                # all our queries see the visiting first chunk, none its second
                lambda st, kb=kb, vb=vb: _merge(st, *fwd(q, kb[:, :c], vb[:, :c], False,
                                                         spec.scale)),
                # only our second chunk sees the visitor, both of its chunks
                lambda st, kb=kb, vb=vb: _merge_second_half(
                    st, *fwd(q[:, c:], kb, vb, False, spec.scale), c),
                state)
    acc, m = state
    return acc.astype(q.dtype), m


def _ring_backward(q, k, v, out, lse, dout, spec: RingSpec, blocks: Blocks):
    """Backward ring: dQ stays local; dK/dV (fp32) travel with their K/V
    block and go home after the last step."""
    n, bwd = spec.n, blocks.bwd
    rank = lax.axis_index(AXIS)
    perm = [(i, (i + 1) % n) for i in range(n)]
    c = q.shape[1] // 2
    add = lambda acc, g: acc + g.astype(F32)
    dq, dk, dv = (g.astype(F32) for g in bwd(q, k, v, out, lse, dout, spec.causal, spec.scale))
    kb, vb = k, v
    for step in range(1, n):
        kb, vb, dk, dv = (lax.ppermute(x, AXIS, perm) for x in (kb, vb, dk, dv))
        src = (rank - step) % n
        if not spec.causal:
            g = bwd(q, kb, vb, out, lse, dout, False, spec.scale)
            dq, dk, dv = add(dq, g[0]), add(dk, g[1]), add(dv, g[2])
            continue

        def earlier(acc, kb=kb, vb=vb):
            dq, dk, dv = acc
            if spec.layout == "contiguous":
                g = bwd(q, kb, vb, out, lse, dout, False, spec.scale)
                return add(dq, g[0]), add(dk, g[1]), add(dv, g[2])
            g = bwd(q, kb[:, :c], vb[:, :c], out, lse, dout, False, spec.scale)
            return add(dq, g[0]), dk.at[:, :c].add(g[1].astype(F32)), \
                dv.at[:, :c].add(g[2].astype(F32))

        def later(acc, kb=kb, vb=vb):
            if spec.layout == "contiguous":
                return acc
            dq, dk, dv = acc
            g = bwd(q[:, c:], kb, vb, out[:, c:], lse[..., c:], dout[:, c:], False, spec.scale)
            return dq.at[:, c:].add(g[0].astype(F32)), add(dk, g[1]), add(dv, g[2])

        dq, dk, dv = lax.cond(src < rank, earlier, later, (dq, dk, dv))
    if n > 1:
        dk, dv = lax.ppermute(dk, AXIS, perm), lax.ppermute(dv, AXIS, perm)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def cudnn_ring(spec: RingSpec, blocks: Blocks) -> Callable:
    """Per-device ring attention (call inside shard_map) with a custom VJP."""

    @jax.custom_vjp
    def ring(q, k, v):
        return _ring_forward(q, k, v, spec, blocks)[0]

    def ring_fwd(q, k, v):
        out, lse = _ring_forward(q, k, v, spec, blocks)
        return out, (q, k, v, out, lse)

    def ring_bwd(res, dout):
        if blocks.bwd is None:
            raise Unavailable(blocks.bwd_note)
        return _ring_backward(*res, dout, spec, blocks)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


# ---- helpers -------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


@jax.jit
def _errors_jit(a, b):
    a, b = a.astype(F32), b.astype(F32)
    d = a - b
    l2 = jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
    axes = tuple(range(2, a.ndim))
    row_ref = jnp.sqrt(jnp.sum(b * b, axis=axes))
    # rows far below the typical norm (e.g. dq of token 0 under a causal mask,
    # exactly 0) are measured against the mean row norm instead
    row = jnp.sqrt(jnp.sum(d * d, axis=axes)) / jnp.maximum(
        jnp.maximum(row_ref, jnp.mean(row_ref)), 1e-30)
    finite = jnp.all(jnp.isfinite(a))
    return jnp.where(finite, l2, jnp.inf), jnp.where(finite, jnp.max(row), jnp.inf)


def _errors(a, b) -> tuple[float, float]:
    """(relative L2 error of a against b, worst per-token relative error);
    inf when a has a NaN or inf. Rows are the sequence axis (axis 1)."""
    if getattr(b, "sharding", None) != getattr(a, "sharding", None):
        b = jax.device_put(b, a.sharding)
    l2, row = _errors_jit(a, b)
    return float(l2), float(row)


def _flops(dims: Dims, s: int, n: int, causal: bool, backward: bool) -> float:
    """Per-GPU FLOPs of one call (causal: unmasked work only)."""
    f = 4.0 * dims.batch * (s / n) * s * dims.heads * dims.head_dim
    return f * (0.5 if causal else 1.0) * (BWD_FLOP_FACTOR if backward else 1.0)


def _timed(fn: Callable[[], Any]) -> float:
    """Median ms per call; `fn` was already compiled and run by the guard.
    Batches of ~0.1 s (2 to 10 calls) keep long sequences affordable."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    once = time.perf_counter() - t0
    calls = int(min(10, max(2, 0.1 / max(once, 1e-6))))
    return time_ms(fn, calls=calls, batches=5, warmup=1)


def _random(key, shape, dtype, sharding):
    return jax.jit(lambda k: jax.random.normal(k, shape, F32).astype(dtype),
                   out_shardings=sharding)(key)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _reference_rows(q, k, v, rows, causal: bool, scale: float):
    """fp32 attention of the natural-order query rows `rows` against the whole
    sequence: [B, R, Hq, D]."""
    qr = jnp.take(q, rows, axis=1)
    _, s, _ = _grouped_scores(qr, k, False, scale)
    if causal:
        s = jnp.where(rows[:, None] >= jnp.arange(k.shape[1])[None, :], s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    b, r, hq, d = qr.shape
    return jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32), precision=HI).reshape(b, r, hq, d)


def _sample_rows(s: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Natural positions to check: both ends of every zigzag chunk, an even
    spread, and a few random ones."""
    c = s // (2 * n)
    ends = [x for i in range(2 * n) for x in (i * c, (i + 1) * c - 1)]
    rows = np.concatenate([ends, np.linspace(0, s - 1, 32).astype(int), rng.integers(0, s, 16)])
    return np.unique(np.clip(rows, 0, s - 1)).astype(np.int32)


# ---- one (sequence, mask) group of rows -----------------------------------------
class Group:
    """Runs the implementations of one (n, S, mask, pass) and records rows."""

    def __init__(self, bench: "Bench", n: int, s: int, causal: bool, backward: bool):
        self.b, self.n, self.s, self.causal, self.backward = bench, n, s, causal, backward
        self.times: dict[str, float] = {}
        self.status: dict[str, tuple[str, str]] = {}  # name -> (status, reason)
        self.layouts: dict[str, str] = {}
        self.mechanisms: dict[str, str] = {}  # pk rows: the mechanism (":C" for forced CTAs)

    def fail(self, name: str, status: str, reason: str) -> None:
        self.status[name] = (status, reason)
        loud = "!!!!" if status == "FAILED" else "--"
        print(f"{loud} n={self.n} S={self.s} {'causal' if self.causal else 'non-causal'} "
              f"{'fwd+bwd' if self.backward else 'fwd'} {name}: {status}: {reason}", flush=True)

    def time(self, name: str, layout: str, fn: Callable[[], Any], divide: int = 1) -> None:
        """Time fn unless the guard already failed or skipped `name`."""
        self.layouts[name] = layout
        if name in self.status:
            return
        try:
            self.times[name] = _timed(fn) / divide
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            self.fail(name, "error", _first_line(e))

    def rows(self) -> list[dict[str, Any]]:
        """Result rows (JSON) with ratios against this group's baselines."""
        d, n, s = self.b.dims, self.n, self.s
        flops = _flops(d, s, n, self.causal, self.backward)
        ideal = self.times.get("ideal") or self.times.get("cudnn")
        rings = {k: v for k, v in self.times.items() if k.startswith("cudnn_ring")}
        best = min(rings.values()) if rings else self.times.get("cudnn")
        out = []
        for name in dict.fromkeys([*self.layouts, *self.status]):
            ms = self.times.get(name)
            status, reason = self.status.get(name, ("ok", ""))
            same = rings.get("cudnn_ring_" + self.layouts.get(name, ""))
            out.append({
                "op": "ring_attention", "gpus": n, "seq": s, "mask": "causal" if self.causal
                else "none", "pass": "fwd+bwd" if self.backward else "fwd",
                "implementation": name, "layout": self.layouts.get(name), "status": status,
                "reason": reason, "batch": d.batch, "heads": d.heads, "kv_heads": d.kv_heads,
                "head_dim": d.head_dim, "dtype": jnp.dtype(d.dtype).name,
                "mechanism": self.mechanisms.get(name),
                "median_ms": ms, "tflops_per_gpu": flops / (ms * 1e-3) / 1e12 if ms else None,
                "ideal_ms": ideal, "baseline": "best cudnn_ring" if n > 1 else "cudnn",
                "baseline_median_ms": best, "cudnn_ring_same_layout_ms": same,
                "of_ideal": ideal / ms if ms and ideal else None,
                "vs_baseline": best / ms if ms and best else None,
                "vs_cudnn_ring_same_layout": same / ms if ms and same else None})
        return out


def table_row(r: dict[str, Any]) -> list[Any]:
    """One JSON row as a RESULTS.md table row."""
    fmt = lambda x, f: "-" if x is None else format(x, f)
    ms = r["median_ms"]
    impl = r["implementation"] if r["status"] == "ok" else f"{r['implementation']} **{r['status']}**"
    tf = r["tflops_per_gpu"]
    return [r["gpus"], r["seq"], r["mask"], r["pass"], impl, fmt(ms, ".3f"),
            fmt(tf, ".0f" if tf is None or tf >= 10 else ".2g"), fmt(r["of_ideal"], ".1%"),
            "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x"]


class Bench:
    """Inputs, meshes and implementations; one run of the benchmark."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dims = Dims(args.batch, args.heads, args.kv_heads or args.heads, args.head_dim)
        self.devices = jax.devices()
        self.rng = np.random.default_rng()
        self.blocks: Blocks | None = None
        self.skip_reason = ""
        if args.emulate_cudnn:
            self.blocks = einsum_blocks()
        else:
            try:
                self.blocks = cudnn_blocks()
            except Unavailable as e:
                self.skip_reason = str(e)
        if self.blocks is None:
            print(f"-- cuDNN rows (cudnn_ring, ideal, world-size-1 cudnn) skipped: "
                  f"{self.skip_reason}", flush=True)
        else:
            print(f"-- block attention: {self.blocks.name} ({self.blocks.note})", flush=True)
            if args.backward and self.blocks.bwd is None:
                print(f"-- cuDNN ring backward skipped: {self.blocks.bwd_note}", flush=True)

    # inputs --------------------------------------------------------------
    def inputs(self, mesh, s: int, seed: int):
        """Natural-order q, k, v, w (output weights for the loss), sharded on
        the sequence over `mesh`."""
        d = self.dims
        sh = NamedSharding(mesh, SEQ)
        keys = jax.random.split(jax.random.key(seed), 4)
        q = _random(keys[0], (d.batch, s, d.heads, d.head_dim), d.dtype, sh)
        k = _random(keys[1], (d.batch, s, d.kv_heads, d.head_dim), d.dtype, sh)
        v = _random(keys[2], (d.batch, s, d.kv_heads, d.head_dim), d.dtype, sh)
        w = _random(keys[3], (d.batch, s, d.heads, d.head_dim), d.dtype, sh)
        return q, k, v, w

    # implementations -----------------------------------------------------
    def sharded(self, mesh, per_device: Callable, check_vma: bool = True) -> Callable:
        """Global (q, k, v) -> output, or -> (loss, grads) with --backward."""
        f = jax.shard_map(per_device, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ,
                          check_vma=check_vma)
        if not self.args.backward:
            return jax.jit(f)
        loss = lambda q, k, v, w: jnp.sum(f(q, k, v).astype(F32) * w.astype(F32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def pk(self, mesh, causal: bool, layout: str, mechanism: str) -> Callable:
        """`mechanism` is "<mechanism>[:C][/<piece order>]": C communicator CTAs
        (ld_st), a `pk_jax.configure(ring_piece_order=...)` for this row."""
        mechanism, _, order = mechanism.partition("/")
        mechanism, _, ctas = mechanism.partition(":")
        kw = dict(num_comm_ctas=int(ctas)) if ctas else {}
        f = self.sharded(mesh, lambda q, k, v: pk_jax.ring_attention(
            q, k, v, AXIS, causal=causal, scale=self.dims.scale, layout=layout,
            mechanism=mechanism, **kw))
        if not order:
            return f

        def in_order(*args):  # the order is read when f is traced (its first call)
            with pk_jax.configured(ring_piece_order=order):
                return f(*args)
        return in_order

    def pk_rows(self, n: int, layout: str) -> list[tuple[str, str]]:
        """(row name, mechanism) of the pk rows: one row named pk_<layout>
        (n = 1: pk) for --mechanism, or pk_<layout>_<mechanism> for each of
        --mechanisms."""
        base = f"pk_{layout}" if n > 1 else "pk"
        if not self.args.mechanisms:
            return [(base, self.args.mechanism)]
        return [(f"{base}_{m.replace(':', '').replace('/', '_')}", m)
                for m in self.args.mechanisms.split(",")]

    def ring(self, mesh, causal: bool, layout: str) -> Callable:
        spec = RingSpec(mesh.size, causal, layout, self.dims.scale)
        return self.sharded(mesh, cudnn_ring(spec, self.blocks), check_vma=False)

    def one_gpu(self, causal: bool, reference: bool = False) -> Callable:
        """Attention of the whole given sequence on one device (cuDNN; for
        `reference` without cuDNN here: XLA's attention)."""
        whole = self.blocks.whole if self.blocks is not None else einsum_blocks().whole
        assert reference or self.blocks is not None
        f = lambda q, k, v: whole(q, k, v, causal, self.dims.scale)
        if not self.args.backward:
            return jax.jit(f)
        loss = lambda q, k, v, w: jnp.sum(f(q, k, v).astype(F32) * w.astype(F32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    # one group ------------------------------------------------------------
    def run_group(self, n: int, s: int, causal: bool) -> Group:
        args, dims = self.args, self.dims
        backward = args.backward
        g = Group(self, n, s, causal, backward)
        mesh = one_axis_mesh(self.devices[:n], AXIS)
        seed = int(self.rng.integers(1 << 31))
        q, k, v, w = self.inputs(mesh, s, seed)
        dev0 = self.devices[0]
        whole1 = [jax.device_put(x, dev0) for x in (q, k, v, w)]  # natural order, one GPU
        layouts = ["zigzag", "contiguous"] if causal and n > 1 else ["contiguous"]
        zig = lambda x: jax.jit(functools.partial(pk_jax.zigzag_shard, axis_size=n),
                                out_shardings=x.sharding)(x)
        by_layout = {"contiguous": (q, k, v, w)}
        if "zigzag" in layouts:
            by_layout["zigzag"] = tuple(zig(x) for x in (q, k, v, w))
        order = {"contiguous": np.arange(s)}
        if "zigzag" in layouts:
            z = np.asarray(pk_jax.zigzag_shard(jnp.arange(s), n, seq_axis=0))
            order["zigzag"] = np.argsort(z)  # natural position -> index in zigzag order
        rows = _sample_rows(s, n, self.rng)
        ref_rows = None if backward else np.asarray(
            _reference_rows(*whole1[:3], jnp.asarray(rows), causal, dims.scale))
        ref_grads = None
        if backward:  # gradients of the whole sequence on one device: the backward reference
            try:
                _, ref_grads = self.one_gpu(causal, reference=True)(*whole1)
            except Exception as e:  # noqa: BLE001
                print(f"-- gradient reference failed ({_first_line(e)}); only pk against the "
                      f"cuDNN ring is compared", flush=True)

        # candidates: name -> (layout, compiled fn, its inputs)
        cands: dict[str, tuple[str, Callable, tuple]] = {}
        for lay in layouts:
            ins = by_layout[lay][: 4 if backward else 3]
            for name, mech in self.pk_rows(n, lay):
                cands[name] = (lay, self.pk(mesh, causal, lay, mech), ins)
                g.mechanisms[name] = mech
            if n == 1:
                if self.blocks is not None:
                    cands["cudnn"] = (lay, self.one_gpu(causal), tuple(whole1[: 4 if backward
                                                                           else 3]))
                continue
            if self.blocks is None:
                g.fail(f"cudnn_ring_{lay}", "skipped", self.skip_reason)
            elif backward and self.blocks.bwd is None:
                g.fail(f"cudnn_ring_{lay}", "skipped", self.blocks.bwd_note)
            else:
                cands[f"cudnn_ring_{lay}"] = (lay, self.ring(mesh, causal, lay), ins)
        if n > 1 and not backward:
            lay = layouts[0]
            if s <= args.einsum_max_seq:
                cands["einsum_ring"] = (lay, self.pk(mesh, causal, lay, "xla"), by_layout[lay][:3])
            else:
                g.fail("einsum_ring", "skipped", f"S > --einsum-max-seq {args.einsum_max_seq}")

        # correctness guard: run every candidate once, check, then time the good ones
        results, checked = {}, set()
        for name, (lay, fn, ins) in cands.items():
            g.layouts[name] = lay
            try:
                results[name] = jax.block_until_ready(fn(*ins))
            except Exception as e:  # noqa: BLE001
                g.fail(name, "error", _first_line(e))
                if args.verbose:
                    traceback.print_exc()
                continue
            if backward:
                if ref_grads is None:
                    continue
                grads = results[name][1]
                if lay == "zigzag":
                    want = [zig(jax.device_put(r, grads[0].sharding)) for r in ref_grads]
                else:
                    want = ref_grads
                errs = [_errors(a, b) for a, b in zip(grads, want)]
                bad = [(nm, e) for nm, e in zip("qkv", errs)
                       if not (e[0] <= TOL_GRAD_L2 and e[1] <= TOL_GRAD_ROW)]
                checked.add(name)
                if bad:
                    g.fail(name, "FAILED", "gradients differ from one-GPU attention: " + ", ".join(
                        f"d{nm} rel {e[0]:.3g} worst token {e[1]:.3g}" for nm, e in bad)
                        + f" (seed {seed})")
            else:
                got = np.asarray(jnp.take(results[name], jnp.asarray(order[lay][rows]), axis=1))
                l2, row = _errors(jnp.asarray(got), jnp.asarray(ref_rows))
                checked.add(name)
                if not (l2 <= TOL_L2 and row <= TOL_ROW):
                    g.fail(name, "FAILED", f"output differs from fp32 attention on {len(rows)} "
                           f"sampled rows: rel {l2:.3g}, worst row {row:.3g} (seed {seed})")
        pk_pairs = [(pk_name, "cudnn" if n == 1 else f"cudnn_ring_{lay}")
                    for lay in layouts for pk_name, _ in self.pk_rows(n, lay)]
        for pk_name, ring_name in pk_pairs:  # pk against the cuDNN ring, same inputs, whole output
            if pk_name in results and ring_name in results and not any(
                    g.status.get(x, ("",))[0] == "FAILED" for x in (pk_name, ring_name)):
                checked.update((pk_name, ring_name))
                a, b = results[pk_name], results[ring_name]
                pairs = zip(a[1], b[1]) if backward else [(a, b)]
                tol = (TOL_GRAD_L2, TOL_GRAD_ROW) if backward else (TOL_L2, TOL_ROW)
                for x, y in pairs:
                    l2, row = _errors(x, y)
                    if not (l2 <= tol[0] and row <= tol[1]):
                        g.fail(pk_name, "FAILED", f"differs from the cuDNN ring: rel {l2:.3g}, "
                               f"worst token {row:.3g} (seed {seed})")
                        break
        del results
        for name in cands:
            if name not in checked and name not in g.status:
                g.fail(name, "unchecked", "no reference could be computed; not timed")

        for name, (lay, fn, ins) in cands.items():
            g.time(name, lay, lambda fn=fn, ins=ins: fn(*ins))
        if self.blocks is None:
            g.fail("ideal" if n > 1 else "cudnn", "skipped", self.skip_reason)
        elif n > 1:
            one = self.one_gpu(causal)
            if causal:  # whole-sequence causal on one GPU, divided by n
                g.time("ideal", "one GPU", lambda: one(*whole1[: 4 if backward else 3]), divide=n)
            else:  # S/n queries against all S keys
                part = [x[:, : s // n] for x in (whole1[0], whole1[3])]
                ins = (part[0], whole1[1], whole1[2]) + ((part[1],) if backward else ())
                g.time("ideal", "one GPU", lambda: one(*ins))
        return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768,65536", help="global sequence lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mechanism", default="auto", help="pk_jax.ring_attention mechanism")
    ap.add_argument("--mechanisms", default="",
                    help="time several pk mechanisms, comma-separated, each "
                    "<mechanism>[:C][/<ring_piece_order>] (e.g. copy_engine,copy_engine/heads,"
                    "ld_st,ld_st:8; ld_st:C forces C communicator CTAs); rows "
                    "pk_<layout>_<mechanism>; overrides --mechanism")
    ap.add_argument("--backward", action="store_true",
                    help="time value_and_grad of a weighted sum of the output instead")
    ap.add_argument("--masks", default="none,causal", help="subset of none,causal")
    ap.add_argument("--einsum-max-seq", type=int, default=32768,
                    help="largest S of the einsum ring (it stores S_local^2 fp32 scores)")
    ap.add_argument("--ws1-seq", type=int, default=8192,
                    help="sequence of the world-size-1 rows (0: none)")
    ap.add_argument("--emulate-cudnn", action="store_true",
                    help="fp32 einsum blocks in place of cuDNN (checks the ring logic on CPU)")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="run on this many fake CPU devices (smoke test)")
    ap.add_argument("--no-save", action="store_true",
                    help="print only; leave results/ and RESULTS.md alone")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failing rows")
    args = ap.parse_args()
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cpu_devices}")
        jax.config.update("jax_platforms", "cpu")
    t_start = time.perf_counter()
    bench = Bench(args)
    n = len(bench.devices)
    _size_workspace(bench, n)
    masks = [m.strip() for m in args.masks.split(",")]
    print(f"ring_attention: {n} x {bench.devices[0].device_kind}, {bench.dims}, "
          f"mechanism={args.mechanisms or args.mechanism}, "
          f"{'fwd+bwd' if args.backward else 'fwd'}", flush=True)
    rows: list[dict[str, Any]] = []
    plan = [(n, int(s), m == "causal") for s in args.seqs.split(",") for m in masks]
    if args.ws1_seq:
        plan += [(1, args.ws1_seq, m == "causal") for m in masks]
    for gn, s, causal in plan:
        if gn > 1 and s % (2 * gn):
            print(f"-- S={s} skipped: must divide by 2n = {2 * gn}", flush=True)
            continue
        t0 = time.perf_counter()
        new = bench.run_group(gn, s, causal).rows()
        rows += new
        print(markdown_table(HEADER, [table_row(r) for r in new]), flush=True)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        md = _markdown(bench, rows)
        if not args.no_save:  # after every group: a run cut short keeps what it measured
            # Forward+backward runs keep their own section and JSON.
            write_results("ring_attention_bwd" if args.backward else "ring_attention", rows, md,
                          "python benchmarks/ring_attention.py " + " ".join(sys.argv[1:]))
    print(_markdown(bench, rows))
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    pk_jax.check_errors()
    failed = [r for r in rows if r["status"] == "FAILED"]
    if failed:
        print(f"!!!! {len(failed)} FAILED rows: " + ", ".join(
            f"S={r['seq']} {r['mask']} {r['implementation']}" for r in failed), flush=True)
        return 1
    return 0


def _size_workspace(bench: Bench, n: int) -> None:
    """Every (mechanism, K/V size) keeps its own staging region for the life
    of the process (pk_jax/runtime.py: regions are never reused across
    channels), so a sweep over sizes and mechanisms needs their sum; the
    default 1 GiB holds one 64k problem, not the whole sweep."""
    d, args = bench.dims, bench.args
    kinds = max(1, len((args.mechanisms or args.mechanism).split(",")))
    need = sum(region_bytes(n, (d.batch, int(s) // n, d.kv_heads, d.head_dim))
               for s in args.seqs.split(",")) * kinds
    if need + (64 << 20) > pk_jax.get_config().workspace_bytes:
        pk_jax.configure(workspace_bytes=need + (64 << 20))


def _markdown(bench: Bench, rows: list[dict[str, Any]]) -> str:
    """The RESULTS.md section body: explanation and table."""
    args = bench.args
    md = (f"b{bench.dims.batch} h{bench.dims.heads} kv{bench.dims.kv_heads} d{bench.dims.head_dim} "
          f"bf16, sequence parallel over n GPUs (1-D mesh \"sp\"), pk mechanism "
          f"`{args.mechanisms or args.mechanism}`. Columns: time per call (ms); per-GPU "
          f"TFLOP/s (causal: unmasked "
          f"work only; fwd+bwd: 3.5x the forward); fraction of the no-communication ideal "
          f"(one-GPU cuDNN with the same per-GPU work); speedup over the best cuDNN ring of "
          f"the same mask (Transformer Engine's approach; n=1: over one-GPU cuDNN). "
          f"Causal impls are suffixed with their layout. Every output was checked against an "
          f"fp32 reference (and pk against the cuDNN ring) before timing; FAILED rows are "
          f"not timed.\n\n" + markdown_table(HEADER, [table_row(r) for r in rows]))
    if bench.blocks is not None:
        md += f"\n\nBlock attention: {bench.blocks.note}."
    return md


if __name__ == "__main__":
    raise SystemExit(main())
