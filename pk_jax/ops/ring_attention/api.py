"""pk_jax.ring_attention: sequence-parallel attention over a mesh axis.

Every device of `axis_name` holds a slice of the sequence (q, k and v of the
same tokens); the result equals attention over the whole sequence. Causal
masks use global token positions, computed from the rank and the layout
("contiguous" or "zigzag", see `ring_attention`), so both layouts are exact.

Validation, the mechanism and the backward's block gradients are decided
here, once, at trace time, into one frozen `RingConfig`:
  * "copy_engine" / "ld_st": the fused forward kernel (primitive.py);
  * "cudnn": a ring of cuDNN flash-attention blocks with XLA's
    collective-permutes between them (cudnn.py);
  * "xla": the pure-JAX ring (pk_jax/reference.py);
  * "auto": the kernel mechanism of pk_jax/tuning.py where the kernel takes
    the shapes, else "cudnn" where cuDNN's blocks take them and run here,
    else "xla" (either with a one-time PkJaxFallbackWarning saying why). On
    a ring of one device, tuning.single_gpu_attention's measured choice:
    cuDNN's whole attention, the kernel with its block backward, or the
    kernel's forward with cuDNN's backward (`_single_gpu`).
Gradients: a custom_vjp saving the output and log-sum-exp. The backward is a
ring (bwd_primitive.py): K/V blocks travel with their partial
dK/dV and go home at the end, dq stays local, probabilities are recomputed
from the log-sum-exp (the einsum steps: as the forward formed them, with a
delta of their own, `_backward`), and the summation order is fixed. For the kernel
mechanisms (rings of 2 or more, `deterministic=False`, shapes the block
kernel takes) it is one fused call: the Hopper flash-attention backward
kernel at every step and pk's copy-engine transport between them. Otherwise
each step's block gradients are that kernel (world size 1), cuDNN's
backward (mechanism "cudnn", the kernel mechanisms at head dim 256, which
the block kernel does not take, and one device's "kernel_fwd_cudnn_bwd";
`deterministic=False`, `return_lse=False`) or einsums
(`deterministic=True`, mechanism "xla", other shapes), and the hops XLA
collective-permutes that fly while the steps run.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import _args, groups, reference, runtime, tuning
from pk_jax import _compat
from pk_jax._compat import make_varying, xla_attention
from pk_jax._warnings import warn_once
from pk_jax.ops.ring_attention import attention_bwd_primitive as block_bwd
from pk_jax.ops.ring_attention import bwd_primitive as ring_bwd
from pk_jax.ops.ring_attention import cudnn as ring_attention_cudnn
from pk_jax.ops.ring_attention.primitive import (DEFAULT_COMM_CTAS, KERNEL_MECHANISMS,
                                                 MAX_COMM_CTAS, RingConfig, kernel_problem,
                                                 ring_attention_p)

MECHANISMS = ("auto", *KERNEL_MECHANISMS, "xla", "cudnn")
LAYOUTS = ("contiguous", "zigzag")


# ---- validation ------------------------------------------------------------------
def check_qkv_arrays(op: str, seq: str, q, k, v) -> None:
    """q, k, v are rank-4 [batch, `seq`, heads, head_dim] floating-point arrays
    of one dtype (ValueError / TypeError naming `op` otherwise)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"pk_jax.{op}: {name} must have rank 4 "
                             f"[batch, {seq}, heads, head_dim], got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"pk_jax.{op}: {name} must be floating point "
                            f"(float32, bfloat16, float16, ...), got {a.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"pk_jax.{op}: q, k and v must have the same dtype (as in "
                        f"jax.nn.dot_product_attention), got q {q.dtype}, k {k.dtype} and "
                        f"v {v.dtype}; cast them first")


def _check_shapes(q, k, v) -> None:
    check_qkv_arrays("ring_attention", "seq_local", q, k, v)
    if k.shape != v.shape:
        raise ValueError(f"pk_jax.ring_attention: k and v must have the same shape "
                         f"[batch, seq_local, kv_heads, head_dim], got k {k.shape} "
                         f"and v {v.shape}")
    for dim, what in ((0, "batch"), (1, "seq_local"), (3, "head_dim")):
        if q.shape[dim] != k.shape[dim]:
            raise ValueError(f"pk_jax.ring_attention: q and k/v must have the same {what} "
                             f"(dim {dim}), got q {q.shape} and k/v {k.shape}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"pk_jax.ring_attention: query heads ({q.shape[2]}) must be a "
                         f"multiple of kv heads ({k.shape[2]}) (MHA, GQA and MQA are "
                         "supported)")


def check_scale(op: str, scale, head_dim: int) -> float:
    """The score scale as a float: 1 / sqrt(head_dim) for None, else a real
    number (Python, NumPy or a concrete JAX scalar). It is compiled into the
    kernels, so a traced value is refused with what to do instead."""
    if scale is None:  # head_dim 0: no scores to scale (jax.nn returns an empty result)
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, jax.core.Tracer):
        raise TypeError(f"pk_jax.{op}: scale must be a concrete number (it is compiled into "
                        "the kernel), got a traced value; pass a Python float (e.g. a static "
                        "argument of jit), or multiply q by it and pass scale=1.0")
    if isinstance(scale, (jax.Array, np.ndarray)) and scale.size == 1 \
            and jnp.issubdtype(scale.dtype, jnp.floating):
        scale = float(np.asarray(scale).reshape(()))
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
        raise TypeError(f"pk_jax.{op}: scale must be a real number or None, got "
                        f"{type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"pk_jax.{op}: scale must be finite, got {scale}")
    return float(scale)


def _check_comm_ctas(num_comm_ctas, mechanism: str) -> int:
    """The ld_st communicator CTA count (None: the default)."""
    if num_comm_ctas is None:
        return DEFAULT_COMM_CTAS
    if mechanism not in ("auto", "ld_st"):
        raise ValueError(f"pk_jax.ring_attention: num_comm_ctas applies to mechanism='ld_st' "
                         f"(or 'auto' where it picks ld_st), not {mechanism!r}")
    if isinstance(num_comm_ctas, (bool, np.bool_)) or not isinstance(num_comm_ctas,
                                                                     (int, np.integer)):
        raise TypeError(f"pk_jax.ring_attention: num_comm_ctas must be an int or None, got "
                        f"{type(num_comm_ctas).__name__}")
    if not 1 <= num_comm_ctas <= MAX_COMM_CTAS:
        raise ValueError(f"pk_jax.ring_attention: num_comm_ctas must be 1..{MAX_COMM_CTAS}, "
                         f"got {num_comm_ctas}")
    return int(num_comm_ctas)


def _mechanism(q, k, layout: str, mechanism: str) -> str:
    """The forward mechanism: a kernel mechanism where the kernel takes the
    call ("auto" through pk_jax/tuning.py), else (auto) "cudnn" where
    cuDNN's blocks take the call and run here, else "xla"."""
    if mechanism == "xla" or q.shape[1] == 0 or q.shape[3] == 0:  # empty: nothing to compute
        return "xla"
    if mechanism == "cudnn":
        if why := _compat.cudnn_operand_problem(q):  # k, v: q's dtype and head dim
            raise ValueError(f"pk_jax.ring_attention: mechanism='cudnn' does not take {why}; "
                             "use mechanism='auto' or 'xla' for this call")
        return "cudnn"
    why = kernel_problem(q, k, layout)
    if why is None:
        return tuning.RING_ATTENTION_MECHANISM if mechanism == "auto" else mechanism
    if mechanism in KERNEL_MECHANISMS:
        raise ValueError(f"pk_jax.ring_attention: mechanism={mechanism!r} does not take {why}; "
                         "use mechanism='auto', 'cudnn' or 'xla' for this call")
    if _cudnn_blocks_take(q):
        return tuning.RING_ATTENTION_UNFUSED
    return "xla"


def _cudnn_blocks_take(q) -> bool:
    """Whether cuDNN's blocks (cudnn.py) take q's dtype and
    head dim and can run here."""
    return _compat.cudnn_operand_problem(q) is None and _compat.cudnn_blocks_available()


def _warn_fallback(q, k, layout: str, chosen: str) -> None:
    """The one-time warning of an `auto` call the kernel does not take."""
    why = kernel_problem(q, k, layout)
    ring = ("the ring of cuDNN attention blocks" if chosen == "cudnn"
            else "the pure-JAX ring")
    if why and runtime.available():  # only where the kernel could have run
        warn_once(f"ring_attention-fallback-{chosen}-{why}", f"pk_jax.ring_attention: the "
                  f"fused kernel does not take {why}; using {ring}")


def _single_gpu(q, k, n: int, chosen: str, mechanism: str, causal: bool, return_lse: bool,
                deterministic: bool) -> str | None:
    """What `auto` runs on a ring of one device (the whole sequence here,
    nothing to communicate): pk_jax/tuning.py's measured choice, "cudnn"
    (cuDNN's fused attention and its backward), "kernel" (pk's fused kernel
    and its block backward) or "kernel_fwd_cudnn_bwd" (pk's forward kernel,
    cuDNN's backward fed its output and log-sum-exp); None where no such
    choice applies: another mechanism, n > 1, return_lse (cuDNN's backward
    takes no log-sum-exp cotangent), deterministic (cuDNN does not promise
    bitwise gradients), or cuDNN does not take the shapes or run here."""
    if mechanism != "auto" or return_lse or deterministic or n != 1 \
            or not _compat.cudnn_takes(q, k) or not _compat.cudnn_available():
        return None
    return tuning.single_gpu_attention(q.shape[3], causal, q.shape[1],
                                       chosen in KERNEL_MECHANISMS,
                                       group=q.shape[2] // k.shape[2])


def _block_grads(q, k, layout: str, chosen: str, deterministic: bool,
                 return_lse: bool, single: str | None = None) -> str:
    """How the backward ring computes each step's block gradients
    (RingConfig.block_grads): the block kernel under the kernel mechanisms
    where it takes the shapes, else cuDNN's backward where cuDNN's blocks
    take them and run here (mechanism "cudnn", the forward kernel's head
    dim 256, or one device's "kernel_fwd_cudnn_bwd" (`single`); it takes no
    log-sum-exp cotangent, so not with return_lse), einsums otherwise and
    whenever `deterministic`."""
    if deterministic:
        return "einsum"
    kernel = chosen in KERNEL_MECHANISMS
    kernel_bwd = kernel and block_bwd.kernel_problem(q, k, layout) is None
    cudnn_bwd = not return_lse and (chosen == "cudnn" or (kernel and _cudnn_blocks_take(q)))
    if kernel_bwd and not (single == "kernel_fwd_cudnn_bwd" and cudnn_bwd):
        return "kernel"
    return "cudnn" if cudnn_bwd else "einsum"


def _config(q, k, v, axis_name, causal, scale, layout, mechanism, num_comm_ctas,
            deterministic, return_lse) -> tuple[RingConfig, str | None]:
    """The call's RingConfig and, on a ring of one device under `auto`, the
    measured choice of what runs there (`_single_gpu`)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.ring_attention: mechanism must be one of {MECHANISMS}, "
                         f"got {mechanism!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"pk_jax.ring_attention: layout must be one of {LAYOUTS}, "
                         f"got {layout!r}")
    causal = _args.boolean("ring_attention", "causal", causal)
    deterministic = _args.boolean("ring_attention", "deterministic", deterministic)
    return_lse = _args.boolean("ring_attention", "return_lse", return_lse)
    comm_ctas = _check_comm_ctas(num_comm_ctas, mechanism)
    _check_shapes(q, k, v)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ring_attention: layout='zigzag' needs an even seq_local "
                         f"(two chunks per rank), got {q.shape[1]}; use "
                         "layout='contiguous' or pad the sequence")
    names = groups.axis_names(axis_name, "ring_attention")
    chosen = _mechanism(q, k, layout, mechanism)
    n = lax.axis_size(names)
    single = _single_gpu(q, k, n, chosen, mechanism, causal, return_lse, deterministic)
    block_grads = _block_grads(q, k, layout, chosen, deterministic, return_lse, single)
    scale = check_scale("ring_attention", scale, q.shape[3])
    if n * q.shape[1] > _args.INT32_MAX:
        raise ValueError(f"pk_jax.ring_attention: a global sequence of {n} x {q.shape[1]} "
                         "tokens: positions are int32, so at most 2^31 - 1")
    fused = block_grads == "kernel" and n > 1 and tuning.RING_ATTENTION_BWD_TRANSPORT == "pk"
    cfg = RingConfig(names, n, causal, scale,
                     layout, chosen, mechanism in KERNEL_MECHANISMS,
                     comm_ctas if chosen == "ld_st" else 0,
                     block_grads, "pk" if fused else "xla")
    return cfg, single


# ---- forward and the ring backward ---------------------------------------------------
def _forward(q, k, v, cfg: RingConfig):
    """(out, lse, the rows' running max, their sum): the last two only from
    the pure-JAX ring (None elsewhere), for the einsum backward."""
    if cfg.mechanism in KERNEL_MECHANISMS:
        return (*ring_attention_p.bind(q, k, v, cfg=cfg), None, None)
    if cfg.mechanism == "cudnn":
        return (*ring_attention_cudnn.forward(q, k, v, cfg), None, None)
    return reference.ring_attention(q, k, v, cfg.names, n=cfg.n, causal=cfg.causal,
                                    scale=cfg.scale, layout=cfg.layout, row_stats=True)


def _backward(cfg: RingConfig, q, k, v, out, lse, row_max, row_sum, dout, dlse):
    """(dq, dk, dv) from the forward's output and log-sum-exp (`dlse` may be
    None): the fused backward (one pk_ring_attention_bwd call) for
    `cfg.bwd_transport` "pk", else the XLA-collective ring whose steps run
    `cfg.block_grads` (bwd_primitive.py; block_grads "cudnn":
    the steps of cudnn.py).

    The einsum steps recompute the probabilities as the forward formed them
    (the pure-JAX ring's running max and sum, `row_max` and `row_sum`, where
    it ran; else from the log-sum-exp) and take delta from a first ring pass
    over the same probabilities (`ring_bwd.ppermute_delta`), so that ds = p
    (dp - delta) cancels exactly where the softmax is one-hot: at large
    scales their dq and dk are as accurate as jax.nn.dot_product_attention's
    (rowsum(dout * out) is off by a rounding, which the scale multiplies).
    The kernels and cuDNN take rowsum(dout * out)."""
    f32 = jnp.float32
    einsum = cfg.block_grads == "einsum"
    if einsum:
        m, l = (lse, None) if row_max is None else (row_max, row_sum)
        delta = ring_bwd.ppermute_delta(cfg, q, dout, m.astype(f32), k, v, l)
    else:  # rowsum(dO * O)
        delta = jnp.einsum("bshd,bshd->bhs", dout.astype(f32), out.astype(f32))
    # delta' = delta - dlse: what the softmax's backward subtracts.
    if dlse is not None:
        delta = delta - dlse.astype(f32)
    lse = lse.astype(f32)
    if cfg.bwd_transport == "pk":
        dq, dk, dv = ring_bwd.fused_backward(cfg, q, dout, lse, delta, k, v)
    elif einsum:
        dq, dk, dv = ring_bwd.ppermute_backward(cfg, q, dout, m.astype(f32), delta, k, v,
                                                row_sum=l)
    else:
        steps = (ring_attention_cudnn.block_grads(cfg, q, out, lse, dout, delta)
                 if cfg.block_grads == "cudnn" else None)
        dq, dk, dv = ring_bwd.ppermute_backward(cfg, q, dout, lse, delta, k, v, grads=steps)
    return dq.astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attend(q, k, v, cfg: RingConfig):
    return _forward(q, k, v, cfg)[:2]


def _attend_fwd(q, k, v, cfg: RingConfig):
    out, lse, row_max, row_sum = _forward(q, k, v, cfg)
    return (out, lse), (q, k, v, out, lse, row_max, row_sum)


def _attend_bwd(cfg: RingConfig, res, cotangents):
    dout, dlse = cotangents
    return _backward(cfg, *res, dout, dlse)


_attend.defvjp(_attend_fwd, _attend_bwd)


# ---- public API ----------------------------------------------------------------
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   axis_name: str | Sequence[str], *, causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous",
                   return_lse: bool = False, mechanism: str = "auto",
                   num_comm_ctas: int | None = None, deterministic: bool = False):
    """Attention over a sequence sharded along `axis_name`; equal to
    `jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)` on
    the whole (unsharded) sequence, this device's rows.

    Call inside `jax.shard_map` with the sequence dim sharded over
    `axis_name`. Every device's K/V block reaches every other device (the
    fused kernel's copy-engine or communicator-CTA pushes, or the pure-JAX
    ring's ppermutes); scores and the softmax are fp32 whatever the input
    dtype. Differentiable (first order): the backward is a ring too (module
    docstring).

    Args:
      q: this device's queries [B, S_local, Hq, D], floating point.
      k: keys [B, S_local, Hkv, D] of the same tokens; Hq must be a multiple
        of Hkv (query head h uses kv head h // (Hq // Hkv): GQA / MQA).
      v: values, same shape as k. q, k and v must have one dtype.
      axis_name: mesh axis (or tuple of axes) the sequence is sharded over.
        A tuple ranks devices row-major over the axes in the order given
        (`lax.axis_index(axis_name)`), which must be the order the sequence
        is sharded in: for a sequence sharded as P(None, ("a", "b")), pass
        ("a", "b"), not ("b", "a"). The order cannot be checked: another
        one gives wrong results without an error. On a mesh {"a": 2,
        "b": 2}, device (a=0, b=1) holds sequence block 1 under
        P(None, ("a", "b")), but ("b", "a") ranks it 2, so its queries and
        keys get the positions of block 2 and a causal mask hides the wrong
        keys.
      causal: mask keys at later global positions than the query (a bool).
      scale: score scale; None: 1 / sqrt(D).
      layout: which global tokens this device holds. "contiguous": rank r
        holds [r * S_local, (r + 1) * S_local). "zigzag": the sequence is cut
        into 2n chunks of S_local / 2 and rank r holds chunks r and
        2n - 1 - r (balanced causal work; S_local must be even). The layout
        is what the data is, not a reordering this op does: reorder global
        arrays with `zigzag_shard` before sharding them, and the output
        with `zigzag_unshard`. Naturally ordered data passed with
        layout="zigzag" gives wrong causal results without an error (the
        op cannot tell the orders apart):

            q, k, v = (pk_jax.zigzag_shard(a, n) for a in (q, k, v))
            out = pk_jax.zigzag_unshard(sharded_ring(q, k, v), n)

        where `sharded_ring` is the shard_map of this op with
        layout="zigzag" (sequence sharded as P(None, axis_name)).
      return_lse: also return the log-sum-exp of the scaled scores.
      mechanism: "auto" (the fused kernel where it takes the shapes, with the
        mechanism of pk_jax/tuning.py; else the ring of cuDNN blocks where
        they take the shapes and cuDNN runs here, else the pure-JAX ring,
        either with a one-time warning), "copy_engine" (the fused kernel;
        the copy engines push K/V to the peers: bf16/fp16, head dim 64,
        128 or 256, S_local a multiple of 128, or of 256 for zigzag;
        ValueError for other shapes), "ld_st" (the same kernel with `num_comm_ctas`
        communicator CTAs pushing K/V over NVLink instead), "cudnn" (each
        ring step one cuDNN flash-attention call, XLA's collective-permutes
        between the steps: bf16/fp16, head dims multiple of 8 up to 256, any
        S_local; where cuDNN cannot run, as on CPU, the same ring with fp32
        einsum blocks) or "xla" (the pure-JAX ring).
      num_comm_ctas: "ld_st" only: the communicator CTAs (SMs) pushing K/V,
        1..32; None: 16.
      deterministic: bitwise-reproducible gradients: the backward's block
        gradients are einsums in the ring's fixed order, never the
        block-backward kernel or cuDNN's (whose dq reduce-adds land in
        arrival order). The forward is deterministic either way.

    An empty sequence (S_local = 0) or head dim (D = 0) gives the empty
    result, as jax.nn.dot_product_attention does.

    Returns:
      out [B, S_local, Hq, D] in q's dtype, and with return_lse also the
      natural log-sum-exp [B, Hq, S_local] in float32 (of the scaled
      scores; a row with no visible key, impossible with these layouts,
      would get output 0 and log-sum-exp -1e30, never NaN).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cfg, single = _config(q, k, v, axis_name, causal, scale, layout, mechanism, num_comm_ctas,
                          deterministic, return_lse)
    q, k, v = (make_varying(x, cfg.names) for x in (q, k, v))
    if single == "cudnn":
        # one device: cuDNN's whole attention (tuning.single_gpu_attention)
        return _compat.cudnn_attention(q, k, v, scale=cfg.scale, is_causal=cfg.causal)
    if mechanism == "auto" and cfg.mechanism in ("xla", "cudnn"):
        _warn_fallback(q, k, layout, cfg.mechanism)
    if q.shape[1] == 0:  # no tokens: an empty result, as jax.nn.dot_product_attention
        out, lse = jnp.zeros_like(q), jnp.zeros((q.shape[0], q.shape[2], 0), jnp.float32)
        return (out, lse) if return_lse else out
    if cfg.mechanism == "xla" and cfg.n == 1 and not return_lse:
        # One rank holds the whole sequence in natural order (zigzag with one
        # rank is the identity): XLA's own attention is what "xla" means here.
        return xla_attention(q, k, v, scale=cfg.scale, is_causal=cfg.causal)
    out, lse = _attend(q, k, v, cfg)
    return (out, lse) if return_lse else out
