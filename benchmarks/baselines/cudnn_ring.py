"""Sequence-parallel attention as a strong JAX user writes it without pk_jax:
a ppermute ring of cuDNN flash-attention blocks merged by their
log-sum-exp (Transformer Engine's approach), forward and backward.

This is the fair baseline for `pk_jax.ring_attention`: each ring step runs
cuDNN flash attention on the visiting K/V block and merges its output into
the running one with the block's log-sum-exp. Causal zigzag follows TE's
recipe (step 0: the local block causal; later steps: a block from an earlier
rank is seen by all our queries through its first half only, a block from a
later rank only by our second half, both without mask); causal contiguous
skips the blocks of later ranks. The backward is a custom VJP: a second ring
of cuDNN backward calls fed the global output and log-sum-exp, dK/dV (fp32)
travelling with their block and sent home after the last step.

Use inside `jax.shard_map` over the sequence axis, arrays [B, S_local, H, D]
(K/V may have fewer heads than Q: grouped-query attention):

    from baselines.cudnn_ring import cudnn_blocks, ring_attention

    blocks = cudnn_blocks()  # once, before tracing; raises Unavailable off GPU
    f = jax.jit(jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, "sp", causal=True, layout="zigzag",
                                       blocks=blocks),
        mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
        check_vma=False))

Layouts: "contiguous" (rank r holds rows [r*S/n, (r+1)*S/n)) or "zigzag"
(the sequence cut into 2n chunks; rank r holds chunks r and 2n-1-r, the
order `pk_jax.zigzag_shard` produces). benchmarks/ring_attention.py (and so
every measurement in benchmarks/RESULTS.md) runs it with check_vma=False;
with einsum blocks on CPU check_vma=True works too (not tried with cuDNN
blocks).

Blocks: `cudnn_blocks()` wraps jax's cuDNN attention, through
`pk_jax._compat.cudnn_block` / `cudnn_block_bwd` (jax's calls only, wrapped
once for this baseline and pk_jax's own ring of cuDNN blocks). The
log-sum-exp comes from jax's cuDNN wrapper with return_residual=True (fp32
from `jax._src.cudnn.fused_attention_stablehlo` where available; the public
`jax.nn.dot_product_attention` rounds it to the input dtype). The backward
binds jax's cuDNN backward primitive with the global statistics; its operand
list is read from the installed jax. The blocks are probed at start-up on
small cases against an fp32 einsum: a forward mismatch raises Unavailable,
a backward mismatch leaves `bwd` None with the reason in `bwd_note`.
`einsum_blocks()` puts fp32 einsum blocks in cuDNN's place (any platform:
checks the ring logic on CPU).

Self-check on CPU devices (einsum blocks against dense fp32 attention, and
the probe's code path): python benchmarks/baselines/cudnn_ring.py
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax import _compat  # jax's private cuDNN blocks, wrapped once (pk_jax's ring uses them)

NEG = -1e30  # log-sum-exp of an empty block: merges as weight 0, never NaN
F32 = jnp.float32
HI = lax.Precision.HIGHEST  # fp32 references: no TF32 on GPUs
# bf16 tolerances of the relative L2 error of a whole tensor (outputs,
# gradients): bf16 rounding alone gives ~0.3%. The probe uses them.
TOL_L2, TOL_GRAD_L2 = 2e-2, 3e-2
LAYOUTS = ("contiguous", "zigzag")


class Unavailable(Exception):
    """A baseline cannot run here; the message says why."""


# ---- block attention: fp32 einsum (CPU checks) and cuDNN ------------------------
class Blocks(NamedTuple):
    """One attention block and its backward with given global statistics.

    fwd(q, k, v, causal, scale) -> (out [B,T,Hq,D] in q's dtype, lse [B,Hq,T] f32)
    bwd(q, k, v, out, lse, dout, causal, scale) -> (dq, dk, dv) in input dtypes,
        the block's share of the gradient when `out` / `lse` are the final
        (all-block) output and log-sum-exp of these query rows; None when
        unavailable (then `bwd_note` says why).
    whole(q, k, v, causal, scale) -> out: differentiable attention on one device
        (the one-GPU ideal, and the gradient reference).
    Causal masks are top-left aligned.
    """

    name: str
    fwd: Callable
    bwd: Callable | None
    whole: Callable
    note: str
    bwd_note: str = ""


def grouped_scores(q, k, causal: bool, scale: float):
    """(q as fp32 [B, T, Hkv, G, D], fp32 scores [B, Hkv, G, T, S], causal
    mask [T, S] top-left aligned or None); query head h uses kv head h // G."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q5 = q.astype(F32).reshape(b, t, hk, hq // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q5, k.astype(F32), precision=HI) * scale
    mask = (jnp.arange(t)[:, None] >= jnp.arange(k.shape[1])[None, :]) if causal else None
    return q5, s, mask


def einsum_fwd(q, k, v, causal: bool, scale: float):
    """Reference block attention in fp32 (same contract as cuDNN's)."""
    b, t, hq, d = q.shape
    _, s, mask = grouped_scores(q, k, causal, scale)
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
    q5, s, mask = grouped_scores(q, k, causal, scale)
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
    """fp32 einsum blocks standing in for cuDNN (any platform)."""
    whole = lambda q, k, v, causal, scale: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="xla")
    return Blocks("einsum (emulating cuDNN)", einsum_fwd, einsum_bwd, whole,
                  "fp32 einsum blocks in place of cuDNN")


def cudnn_blocks() -> Blocks:
    """cuDNN flash attention blocks, probed against fp32 einsum on the first
    device; raises Unavailable with the reason. Call it before tracing (the
    probe runs on concrete arrays)."""
    devs = jax.devices()
    if devs[0].platform != "gpu":
        raise Unavailable(f"no CUDA GPU (platform {devs[0].platform}): cuDNN attention needs one")
    notes = []

    def whole(q, k, v, causal, scale):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            implementation="cudnn")

    bwd, bwd_note = None, ""
    if _compat.cudnn_blocks_available():
        def fwd(q, k, v, causal, scale):
            return _compat.cudnn_block(q, k, v, scale=scale, causal=causal)

        def bwd(q, k, v, out, lse, dout, causal, scale):
            return _compat.cudnn_block_bwd(q, k, v, out, lse, dout, scale=scale, causal=causal)
        notes.append("lse: fp32 from jax._src.cudnn (return_residual); backward: jax's cuDNN "
                     "backward primitive fed the ring's statistics")
    elif "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters:
        def fwd(q, k, v, causal, scale):
            out, res = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                    implementation="cudnn", return_residual=True)
            return out, jnp.swapaxes(res, 1, 2).astype(F32)  # [B, T, H] -> [B, H, T]
        notes.append("lse: jax.nn return_residual (rounded to the input dtype)")
        bwd_note = "this jax's private cuDNN module has no backward these blocks can bind"
    else:
        def fwd(q, k, v, causal, scale):
            out = whole(q, k, v, causal, scale)
            _, s, mask = grouped_scores(q, k, causal, scale)
            lse = jax.nn.logsumexp(jnp.where(mask, s, NEG) if causal else s, axis=-1)
            return out, lse.reshape(q.shape[0], q.shape[2], q.shape[1])
        notes.append("lse: this jax has no return_residual; computed by an fp32 einsum "
                     "(correct, but slows the cuDNN ring)")
        bwd_note = "this jax's private cuDNN module has no backward these blocks can bind"
    blocks = Blocks("cudnn", fwd, bwd, whole, "; ".join(notes), bwd_note)
    return probe(blocks)


def probe(blocks: Blocks) -> Blocks:
    """Check `blocks` against fp32 einsum on small cases (GQA, T != S,
    causal) on the first device; raise Unavailable on a forward mismatch or
    failure, drop the backward (with the reason in bwd_note) on a backward
    one. Returns the blocks as they can be used."""
    key = jax.random.split(jax.random.key(0), 4)
    dev = jax.devices()[0]
    bwd, bwd_note = blocks.bwd, blocks.bwd_note
    who = "cuDNN" if blocks.name == "cudnn" else blocks.name
    for causal, t, s in ((False, 128, 256), (True, 256, 256)):
        q = jax.device_put(jax.random.normal(key[0], (2, t, 4, 128), jnp.bfloat16), dev)
        k, v = (jax.device_put(jax.random.normal(kk, (2, s, 2, 128), jnp.bfloat16), dev)
                for kk in key[1:3])
        do = jax.device_put(jax.random.normal(key[3], q.shape, jnp.bfloat16), dev)
        scale = 128 ** -0.5
        try:
            out, lse = jax.jit(blocks.fwd, static_argnums=(3, 4))(q, k, v, causal, scale)
        except Exception as e:  # noqa: BLE001 - any failure means: these blocks do not run here
            raise Unavailable(f"{who} block attention failed: {first_line(e)}") from e
        ref_out, ref_lse = einsum_fwd(q, k, v, causal, scale)
        l2 = rel_l2(out, ref_out)
        lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
        if not (l2 <= TOL_L2 and lse_err <= 0.05):
            raise Unavailable(f"{who} block attention disagrees with fp32 einsum "
                              f"(causal={causal}, T={t}, S={s}): output rel err {l2:.3g}, "
                              f"lse max err {lse_err:.3g}")
        if bwd is None:
            continue
        try:
            got = jax.jit(bwd, static_argnums=(6, 7))(q, k, v, ref_out, ref_lse, do, causal, scale)
        except Exception as e:  # noqa: BLE001
            bwd, bwd_note = None, (f"{who} backward with given statistics failed: "
                                   f"{first_line(e)}")
            continue
        want = einsum_bwd(q, k, v, ref_out, ref_lse, do, causal, scale)
        errs = [rel_l2(a, b) for a, b in zip(got, want)]
        if not max(errs) <= TOL_GRAD_L2:
            bwd, bwd_note = None, (f"{who} backward with given statistics disagrees "
                                   f"with fp32 einsum (causal={causal}): dq/dk/dv rel err {errs}")
    return blocks._replace(bwd=bwd, bwd_note=bwd_note)


# ---- the ring (Transformer Engine style) ---------------------------------------
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
    """Static description of one ring: n ranks on mesh axis `axis_name`."""

    n: int
    causal: bool
    layout: str  # "contiguous" | "zigzag"
    scale: float
    axis_name: str = "sp"


def _ring_forward(q, k, v, spec: RingSpec, blocks: Blocks):
    """Forward ring of blocks; returns (out in q's dtype, lse [B,H,T] f32)."""
    n, fwd, axis = spec.n, blocks.fwd, spec.axis_name
    rank = lax.axis_index(axis)
    perm = [(i, (i + 1) % n) for i in range(n)]
    c = q.shape[1] // 2
    out, lse = fwd(q, k, v, spec.causal, spec.scale)  # step 0: our own block
    state = (out.astype(F32), lse)
    kb, vb = k, v
    for step in range(1, n):
        kb, vb = lax.ppermute(kb, axis, perm), lax.ppermute(vb, axis, perm)
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
    n, bwd, axis = spec.n, blocks.bwd, spec.axis_name
    rank = lax.axis_index(axis)
    perm = [(i, (i + 1) % n) for i in range(n)]
    c = q.shape[1] // 2
    add = lambda acc, g: acc + g.astype(F32)
    dq, dk, dv = (g.astype(F32) for g in bwd(q, k, v, out, lse, dout, spec.causal, spec.scale))
    kb, vb = k, v
    for step in range(1, n):
        kb, vb, dk, dv = (lax.ppermute(x, axis, perm) for x in (kb, vb, dk, dv))
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
        dk, dv = lax.ppermute(dk, axis, perm), lax.ppermute(dv, axis, perm)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def cudnn_ring(spec: RingSpec, blocks: Blocks) -> Callable:
    """Per-device ring attention (q, k, v) -> out for `spec`, with the
    backward ring as its custom VJP; call it inside shard_map."""

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


def _eagerly(make: Callable[[], Blocks]) -> Blocks:
    """make() with every jax op evaluated now, even mid-trace: the probe
    compares concrete numbers."""
    with jax.ensure_compile_time_eval():
        return make()


@functools.cache
def _default_blocks() -> Blocks:
    return _eagerly(cudnn_blocks)


def ring_attention(q, k, v, axis_name: str, *, causal: bool = False, layout: str = "contiguous",
                   scale: float | None = None, blocks: Blocks | None = None):
    """Attention of this rank's queries against the whole sequence, sharded
    over `axis_name` (call inside shard_map). q [B, S_local, Hq, D], k and v
    [B, S_local, Hkv, D] with Hq a multiple of Hkv; returns [B, S_local, Hq, D]
    in q's dtype. `layout`: how the sequence is spread over the ranks
    ("contiguous" or "zigzag", see the module docstring); `scale` defaults
    to 1/sqrt(D); `blocks` defaults to `cudnn_blocks()` (probed once per
    process; raises Unavailable without a working cuDNN). Differentiable:
    the backward is the backward ring (raises Unavailable if the blocks have
    no backward)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    n = lax.axis_size(axis_name)
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"zigzag needs an even local sequence length, got {q.shape[1]}")
    spec = RingSpec(n, causal, layout, q.shape[-1] ** -0.5 if scale is None else float(scale),
                    axis_name)
    return cudnn_ring(spec, _default_blocks() if blocks is None else blocks)(q, k, v)


# ---- helpers -------------------------------------------------------------------
def first_line(e: BaseException) -> str:
    """The exception's type and the first line of its message (300 characters)."""
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def rel_l2(a, b) -> float:
    """Relative L2 error of a against b (fp32)."""
    a, b = a.astype(F32), b.astype(F32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


# ---- self-check on CPU devices ---------------------------------------------------
def _zigzag_order(s: int, n: int):
    """Natural positions in zigzag order: rank r's rows are chunks r and
    2n-1-r of 2n (the order pk_jax.zigzag_shard produces)."""
    c = s // (2 * n)
    chunks = [i for r in range(n) for i in (r, 2 * n - 1 - r)]
    return jnp.concatenate([jnp.arange(i * c, (i + 1) * c) for i in chunks])


def _self_check(devices: int) -> int:
    """einsum blocks through the ring (every layout, mask, 1..`devices`
    ranks, GQA, fp32 and bf16) against dense fp32 attention on the whole
    sequence, forward and gradients; then the probe and the default-blocks
    path on einsum blocks. Prints the errors; returns the number of failures."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    blocks = einsum_blocks()
    dense = lambda q, k, v, causal: blocks.whole(q, k, v, causal, q.shape[-1] ** -0.5)
    tol = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (TOL_L2, TOL_GRAD_L2)}
    failures = 0
    print(f"{'n':>2} {'dtype':>8} {'mask':>6} {'layout':>10} {'hq/hkv':>6}  "
          f"{'out rel':>9} {'dq rel':>9} {'dk rel':>9} {'dv rel':>9}")
    for n in sorted({1, 2, devices}):
        mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
        spec = NamedSharding(mesh, P(None, "sp"))
        s = 32 * n
        for dtype in (jnp.float32, jnp.bfloat16):
            for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
                for hq, hk in ((4, 4), (4, 2)):
                    keys = jax.random.split(jax.random.key(n * 100 + hq + hk), 4)
                    q, w = (jax.random.normal(kk, (2, s, hq, 64), F32) for kk in keys[::3])
                    k, v = (jax.random.normal(kk, (2, s, hk, 64), F32) for kk in keys[1:3])
                    q, k, v, w = (x.astype(dtype) for x in (q, k, v, w))
                    order = _zigzag_order(s, n) if layout == "zigzag" else jnp.arange(s)
                    ring = jax.shard_map(
                        lambda q, k, v: ring_attention(q, k, v, "sp", causal=causal,
                                                       layout=layout, blocks=blocks),
                        mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                        check_vma=False)
                    # the ring sees every array in `order`; loss and gradients are
                    # taken on natural-order arrays so both sides compare directly
                    ring_nat = lambda q, k, v: jnp.take(ring(*(
                        jax.device_put(jnp.take(x, order, axis=1), spec) for x in (q, k, v))),
                        jnp.argsort(order), axis=1)
                    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(F32) * w.astype(F32))
                    got, want = jax.jit(ring_nat)(q, k, v), dense(q.astype(F32), k.astype(F32),
                                                                  v.astype(F32), causal)
                    g_got = jax.jit(jax.grad(loss(ring_nat), (0, 1, 2)))(q, k, v)
                    g_want = jax.grad(loss(lambda q, k, v: dense(q, k, v, causal)), (0, 1, 2))(
                        *(x.astype(F32) for x in (q, k, v)))
                    errs = [rel_l2(got, want)] + [rel_l2(a, b) for a, b in zip(g_got, g_want)]
                    ok = errs[0] <= tol[dtype][0] and max(errs[1:]) <= tol[dtype][1]
                    failures += not ok
                    print(f"{n:>2} {jnp.dtype(dtype).name:>8} {'causal' if causal else 'none':>6} "
                          f"{layout:>10} {hq:>3}/{hk:<2}  " + " ".join(f"{e:9.2e}" for e in errs)
                          + ("" if ok else "  FAILED"))
    probed = probe(blocks)  # the probe's code path, on blocks that must pass it
    print(f"probe on einsum blocks: forward ok, backward "
          f"{'kept' if probed.bwd is not None else 'dropped: ' + probed.bwd_note}")
    failures += probed.bwd is None
    try:  # the probe must also run mid-trace (ring_attention with blocks=None)
        mid = []
        jax.jit(lambda x: mid.append(_eagerly(lambda: probe(blocks))) or x)(jnp.zeros(()))
        assert mid[0].bwd is not None, mid[0].bwd_note
        print("probe inside a trace (as ring_attention with blocks=None runs it): ok")
    except Exception as e:  # noqa: BLE001
        print(f"probe inside a trace: FAILED: {first_line(e)}")
        failures += 1
    print("self-check:", "all passed" if not failures else f"{failures} FAILED")
    return failures


if __name__ == "__main__":
    import argparse
    import os

    ap = argparse.ArgumentParser(description="Self-check of the ring on CPU devices")
    ap.add_argument("--devices", type=int, default=4, help="fake CPU devices (largest ring)")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    jax.config.update("jax_platforms", "cpu")
    raise SystemExit(1 if _self_check(args.devices) else 0)
