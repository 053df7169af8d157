"""Tensor-parallel matmuls with the communication overlapped:
`all_gather_matmul` and `matmul_reduce_scatter`, each the other's transpose,
and `matmul_all_reduce` (psum(x @ w), the same bits on every rank).

Call inside `jax.shard_map`. On CUDA GPUs the GEMMs run on row chunks while
the copy engines bring the rows in (all_gather_matmul), or write their tiles
straight into the owner's memory (matmul_reduce_scatter); elsewhere, and for
inputs the kernels do not take, XLA's collectives and dot run. The backward
of each of the first two is one kernel call computing dx and dw (the other
op's sequence, with the weight gradient's GEMM placed where it would wait).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import _args, groups, reference, runtime, tuning
from pk_jax._compat import make_varying, sum_to_type_of, vary_alike, varying_axes
from pk_jax._warnings import warn_once
from pk_jax.ops.fp8 import api as fp8_ops
from pk_jax.ops.fp8 import primitive as prim_fp8
from pk_jax.ops.tp_matmul import fp8 as tp_matmul_fp8
from pk_jax.ops.fp8.stored import Fp8Activation, is_stored
from pk_jax.ops.tp_matmul.primitive import (ALL_REDUCE_KERNEL_MECHANISMS, KERNEL_MECHANISMS,
                                             TpConfig, all_gather_matmul_bwd_p,
                                             all_gather_matmul_p, matmul_all_reduce_p,
                                             matmul_reduce_scatter_bwd_p,
                                             matmul_reduce_scatter_p)

MECHANISMS = ("auto", *KERNEL_MECHANISMS, "xla")
ALL_REDUCE_MECHANISMS = ("auto", *ALL_REDUCE_KERNEL_MECHANISMS, "xla")
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _validate(op: str, x, w, axis_name, preferred_element_type, mechanism,
              mechanisms=MECHANISMS, pick=None) -> TpConfig:
    """The call's config, with the mechanism resolved: a kernel mechanism
    (`pick(n)` under "auto", else "chunked") where the kernels take the
    operands, else "xla" (an error if a kernel mechanism was forced). Under
    "auto" an axis of one device runs XLA's dot (`tuning.single_gpu_gemm`)."""
    if mechanism not in mechanisms:
        raise ValueError(f"pk_jax.{op}: mechanism must be one of {mechanisms}, got "
                         f"{mechanism!r}")
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"pk_jax.{op}: expected x [..., rows, K] and w [K, N], got x "
                         f"{x.shape} and w {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"pk_jax.{op}: contraction mismatch, x {x.shape} @ w {w.shape}")
    if x.size == 0 or w.size == 0:  # XLA's collectives reject empty dims too
        raise ValueError(f"pk_jax.{op}: empty operands are not supported, got x {x.shape} "
                         f"and w {w.shape}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"pk_jax.{op}: {name} must be floating point, got {a.dtype}")
    out_dtype = (jnp.dtype(jnp.result_type(x.dtype, w.dtype)) if preferred_element_type is None
                 else _args.dtype(op, "preferred_element_type", preferred_element_type))
    names = groups.axis_names(axis_name, op)
    n = lax.axis_size(names)
    if mechanism == "xla":
        return TpConfig(names, n, out_dtype, "xla")
    why = _kernel_unsupported(x, w, out_dtype)
    forced = mechanism != "auto"
    if why and forced:
        raise ValueError(f"pk_jax.{op}(mechanism={mechanism!r}): {why}")
    if why and runtime.available():  # elsewhere the reference is the plan, not a fallback
        warn_once(f"{op}-{why}", f"pk_jax.{op}: {why}; using the XLA reference path")
    if why or (not forced and n == 1 and tuning.single_gpu_gemm() == "xla"):
        return TpConfig(names, n, out_dtype, "xla")
    if not forced:
        mechanism = pick(n) if pick else "chunked"
    return TpConfig(names, n, out_dtype, mechanism, forced)


def _kernel_unsupported(x, w, out_dtype) -> str:
    """Why the GEMM kernels cannot take these operands ('' if they can)."""
    if x.dtype != w.dtype or x.dtype not in _KERNEL_DTYPES:
        return (f"the kernels take bf16 or fp16 operands of one dtype, got {x.dtype} and "
                f"{w.dtype}")
    if out_dtype not in (x.dtype, jnp.dtype(jnp.float32)):
        return f"the kernels write {x.dtype} or float32, not {out_dtype}"
    if x.shape[-1] % 8 or w.shape[1] % 8:
        return f"K ({x.shape[-1]}) and N ({w.shape[1]}) must be multiples of 8 for the kernels"
    return ""


def _dot_f32(a, b, dtype):
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)


# ---- all_gather_matmul: 2-D core with its VJP ----------------------------------
def _ag(x, w, cfg: TpConfig, return_gathered: bool, transpose_w: bool = False):
    return all_gather_matmul_p.bind(x, w, cfg=cfg, return_gathered=return_gathered,
                                    transpose_w=transpose_w)


def _ag_forward(x, w, cfg):
    out, gathered = _ag(x, w, cfg, True)
    return (out, gathered), (gathered, w)


def _fused_backward(cfg: TpConfig, dy, act, w) -> bool:
    """Whether one kernel call computes dx and dw: a kernel mechanism and dy
    in the operands' dtype (else the two-step path: XLA or the kernels for
    dx, XLA's dot for dw)."""
    return cfg.mechanism != "xla" and dy.dtype == act.dtype == w.dtype


def _bind_backward(prim, cfg: TpConfig, dy, w, act):
    """dx, dw from one call; the operands made to vary over the same axes
    (the primitive's outputs take dy's type)."""
    dy, w, act = vary_alike(dy, w, act)
    return prim.bind(dy, w, act, cfg=dataclasses.replace(cfg, out_dtype=jnp.dtype(act.dtype)))


def _ag_backward(cfg: TpConfig, res, dy, dgathered=None):
    """dx = matmul_reduce_scatter(dy, w^T) (+ the gathered output's share),
    dw = gathered^T @ dy: one kernel call (the dW GEMM hides the wait for
    the peers' partials), else the reduce-scatter then XLA's dot. The
    kernels read w^T in place."""
    gathered, w = res
    x_dtype = gathered.dtype
    if _fused_backward(cfg, dy, gathered, w):
        dx, dw = _bind_backward(all_gather_matmul_bwd_p, cfg, dy, w, gathered)
    else:
        if dy.dtype == x_dtype and cfg.mechanism != "xla":
            dx = _rs_bind(dy, w, dataclasses.replace(cfg, out_dtype=jnp.dtype(x_dtype)),
                          transpose_w=True)
        else:
            dx = reference.matmul_reduce_scatter(dy.astype(x_dtype), w.T.astype(x_dtype),
                                                 cfg.names)
        dw = _dot_f32(gathered, dy.astype(x_dtype), w.dtype)
    if dgathered is not None:
        dx = dx + lax.psum_scatter(dgathered, cfg.names, scatter_dimension=0, tiled=True)
    # the gathered x varies over exactly x's axes
    return sum_to_type_of(dx.astype(x_dtype), gathered), sum_to_type_of(dw, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_out(x, w, cfg):
    return _ag(x, w, cfg, False)[0]


def _ag_out_forward(x, w, cfg):
    (out, _), res = _ag_forward(x, w, cfg)
    return out, res


_ag_out.defvjp(_ag_out_forward, _ag_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_out_gathered(x, w, cfg):
    return tuple(_ag(x, w, cfg, True))


_ag_out_gathered.defvjp(_ag_forward, lambda cfg, res, ct: _ag_backward(cfg, res, *ct))


# ---- matmul_reduce_scatter: 2-D core with its VJP ------------------------------
def _rs_bind(x, w, cfg: TpConfig, transpose_w: bool = False):
    return matmul_reduce_scatter_p.bind(x, w, cfg=cfg, transpose_w=transpose_w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rs(x, w, cfg):
    return _rs_bind(x, w, cfg)


def _rs_forward(x, w, cfg):
    return _rs(x, w, cfg), (x, w)


def _rs_backward(cfg: TpConfig, res, dy):
    """dx, gathered dy = all_gather_matmul(dy, w^T); dw = x^T @ gathered dy:
    one kernel call (the dW GEMM after the GEMMs of the landed rows, on the
    gathered dy in the staging region), else the all-gather matmul then
    XLA's dot. The kernels read w^T in place."""
    x, w = res
    if _fused_backward(cfg, dy, x, w):
        dx, dw = _bind_backward(matmul_reduce_scatter_bwd_p, cfg, dy, w, x)
        return sum_to_type_of(dx, x), sum_to_type_of(dw, w)
    if dy.dtype == x.dtype and cfg.mechanism != "xla":
        dx, gathered_dy = _ag(dy, w, dataclasses.replace(cfg, out_dtype=x.dtype), True,
                              transpose_w=True)
    else:
        dx, gathered_dy = reference.all_gather_matmul(dy.astype(x.dtype), w.T.astype(x.dtype),
                                                      cfg.names)
    dw = _dot_f32(x, gathered_dy.astype(x.dtype), w.dtype)
    return sum_to_type_of(dx.astype(x.dtype), x), sum_to_type_of(dw, w)


_rs.defvjp(_rs_forward, _rs_backward)


# ---- matmul_all_reduce: 2-D core with its VJP --------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ar(x, w, cfg):
    return matmul_all_reduce_p.bind(x, w, cfg=cfg)


def _ar_forward(x, w, cfg):
    return _ar(x, w, cfg), (x, w)


def _ar_backward(cfg: TpConfig, res, dy):
    """psum's transpose hands every rank the (invariant) cotangent, made
    varying (pvary): dx = dy @ w^T, dw = x^T @ dy, both local."""
    x, w = res
    dy = make_varying(dy, cfg.names)
    dx = lax.dot_general(dy, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw = _dot_f32(x, dy, w.dtype)
    return sum_to_type_of(dx.astype(x.dtype), x), sum_to_type_of(dw, w)


_ar.defvjp(_ar_forward, _ar_backward)


# ---- FP8 --------------------------------------------------------------------------
def _fp8_call(op: str, impl, x, w, axis_name, fp8, fp8_scales, preferred_element_type,
              mechanism, rows_per_rank):
    """The FP8 path of `op` (pk_jax/ops/tp_matmul/fp8.py) on x [rows, K] (leading
    dims flattened by the caller's reshape) or an Fp8Activation, and w [K, N]
    or an Fp8Weight: (out, amaxes or None, cfg)."""
    if fp8 is None and not (is_stored(x) or is_stored(w)):
        raise ValueError(f"pk_jax.{op}: fp8_scales needs fp8='delayed' (or an Fp8Recipe "
                         "with scaling='delayed')")
    recipe = fp8_ops.recipe_for(f"pk_jax.{op}", "fp8", fp8, w, x)
    if mechanism != "auto":
        raise ValueError(f"pk_jax.{op}(fp8=...): the FP8 path picks its own mechanisms; "
                         f"leave mechanism='auto' (got {mechanism!r})")
    cfg = _validate(op, *_checked_as(x, w), axis_name, preferred_element_type, "xla")
    for name, a in (("x", x), ("w", w)):
        if not is_stored(a) and jnp.dtype(a.dtype) not in prim_fp8.IN_TYPES:
            raise TypeError(f"pk_jax.{op}(fp8=...): {name} must be bfloat16, float16 or "
                            f"float32 (quantized inside the op; x may be an Fp8Activation, "
                            f"w an Fp8Weight), got {a.dtype}")
    if cfg.out_dtype not in prim_fp8.IN_TYPES:
        raise TypeError(f"pk_jax.{op}(fp8=...): preferred_element_type must be bfloat16, "
                        f"float16 or float32, got {cfg.out_dtype}")
    tp_matmul_fp8.check(op, x, w, recipe, cfg.n, rows_per_rank)
    scales = fp8_ops.checked_scales(f"pk_jax.{op}", "fp8_scales", recipe, fp8_scales)
    x2 = x.reshape(-1, x.shape[-1])
    if op == "all_gather_matmul" and isinstance(x, Fp8Activation) and x.scaling == "tensor":
        _check_gathered_factor(x2, cfg.names)
    x2, w = (jax.tree.map(lambda a: make_varying(a, cfg.names), t) for t in (x2, w))
    if scales is not None and not set(cfg.names) <= varying_axes(x2):
        # unchecked, shard_map's transpose would sum the replicated scales' cotangents
        raise ValueError(f"pk_jax.{op}(fp8='delayed'): needs shard_map's varying-axes types "
                         "(check_vma=True, the default) to return amaxes of the scales' "
                         "type")
    out, amaxes = impl(x2, w, scales, cfg.names, cfg.n, recipe, cfg.out_dtype)
    return out, amaxes, cfg


def _check_gathered_factor(x: Fp8Activation, names) -> None:
    """The gathered rows of a tensor-scaled Fp8Activation form one FP8 operand:
    its factor must be one value over the axis, which shard_map's types show
    (ValueError where they say otherwise or are not checked)."""
    if not set(names) <= varying_axes(x.data):
        raise ValueError("pk_jax.all_gather_matmul: gathering an Fp8Activation with one "
                         "tensor factor needs shard_map's varying-axes types (check_vma=True, "
                         "the default) to check the factor is one value over the axis")
    if set(names) & varying_axes(x.factors):
        raise ValueError(f"pk_jax.all_gather_matmul: the Fp8Activation's tensor factor varies "
                         f"over axis {tuple(names)}: the gathered rows need one factor; "
                         f"quantize with pk_jax.quantize_activation(x, 'tensor', "
                         f"axis_name={tuple(names)!r}) (the axis-wide amax), or use "
                         "scaling='block'")


def _checked_as(x, w):
    """What _validate reads of x and w: a stored operand as one of the other's
    dtype, bfloat16 where both are stored (the output type is the
    unquantized operand's: an FP8 type does not promote)."""
    like = (jnp.dtype(jnp.bfloat16) if is_stored(x) and is_stored(w) else
            w.dtype if is_stored(x) else x.dtype)
    return tuple(jax.ShapeDtypeStruct(a.shape, like) if is_stored(a) else a for a in (x, w))


def _operands(x, w, fp8, fp8_scales):
    """(x, w, whether the FP8 path runs); stored operands as given."""
    return (x if is_stored(x) else jnp.asarray(x), w if is_stored(w) else jnp.asarray(w),
            is_stored(x) or is_stored(w) or fp8 is not None or fp8_scales is not None)


def _fp8_result(out, amaxes, shape):
    out = out.reshape(shape)
    return out if amaxes is None else (out, amaxes)


# ---- public API ----------------------------------------------------------------
def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str | Sequence[str], *,
                      return_gathered: bool = False, preferred_element_type=None,
                      mechanism: str = "auto", fp8=None, fp8_scales=None):
    """`lax.all_gather(x, axis_name, axis=0, tiled=True) @ w`, overlapped.

    Args:
      x: this device's rows, [m, K] or [batch..., K] (leading dims are rows;
        the gather is along the first one).
      w: [K, N_local], e.g. the column shard of a column-parallel layer; or
        this shard stored in FP8 (`pk_jax.Fp8Weight`, in_specs from its
        `partition_spec`): the FP8 path runs with the recipe its scaling
        implies (fp8 may name it), and w's cotangent is zero.
      axis_name: mesh axis (or tuple of axes) to gather over.
      return_gathered: also return the gathered x (what the backward pass of
        the weight needs); it costs one extra copy of x per peer.
      preferred_element_type: output dtype; None: the operands' dtype.
        Accumulation is fp32 either way.
      mechanism: "auto"/"chunked" (GEMMs on row chunks as the copy engines
        bring them in; bf16/fp16 operands, K and N multiples of 8) or "xla".
      fp8: None, or an FP8 recipe (pk_jax.Fp8Recipe or "current", "delayed",
        "block"): x and w are quantized inside the op (x with the axis-wide
        amax under "current"), the quantized rows and their factors are
        gathered, and the forward and both gradients run pk's FP8 GEMMs. K
        and N multiples of 16 (128 for "block"), the rows per device of 16
        (128).
      fp8_scales: with fp8="delayed" (and only there), the scales
        (x_scale, w_scale, dy_scale), each one float32 (the caller's amax
        histories give them; one value on every device of the axis). The
        result is then (out, (amax_x, amax_w)), each [1] and axis-wide (the
        maximum over every device that shares its scale, by pk's all_reduce),
        and the cotangent of dy_scale carries the axis-wide amax(dy), as in
        `pk_jax.fp8_dot`. Needs shard_map's check_vma (the default).

    Returns:
      out [n * x.shape[0], ..., N_local], and with return_gathered the
      gathered x [n * x.shape[0], ..., K]; with fp8_scales (out, amaxes).
    """
    x, w, fp8_path = _operands(x, w, fp8, fp8_scales)
    if fp8_path:
        if return_gathered:
            raise ValueError("pk_jax.all_gather_matmul: return_gathered is not available "
                             "with fp8 (the gathered rows are FP8)")
        rows = int(np.prod(x.shape[:-1])) if x.ndim >= 2 else 0
        out, amaxes, cfg = _fp8_call("all_gather_matmul", tp_matmul_fp8.all_gather_matmul, x,
                                     w, axis_name, fp8, fp8_scales, preferred_element_type,
                                     mechanism, rows)
        return _fp8_result(out, amaxes,
                           (cfg.n * x.shape[0],) + x.shape[1:-1] + (w.shape[1],))
    cfg = _validate("all_gather_matmul", x, w, axis_name, preferred_element_type, mechanism)
    x2 = make_varying(x.reshape(-1, x.shape[-1]), cfg.names)
    w = make_varying(w, cfg.names)
    lead = (cfg.n * x.shape[0],) + x.shape[1:-1]
    if return_gathered:
        out, gathered = _ag_out_gathered(x2, w, cfg)
        return out.reshape(lead + (w.shape[1],)), gathered.reshape(lead + (x.shape[-1],))
    return _ag_out(x2, w, cfg).reshape(lead + (w.shape[1],))


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str | Sequence[str], *,
                          preferred_element_type=None, mechanism: str = "auto",
                          fp8=None, fp8_scales=None):
    """`lax.psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`, overlapped.

    Args:
      x: [M, K_local] or [batch..., K_local], e.g. the activations of a
        row-parallel layer; the first dim must divide by the axis size.
      w: [K_local, N], the row shard of the weight, or an `Fp8Weight` (as
        for all_gather_matmul).
      axis_name: mesh axis (or tuple of axes) to reduce-scatter over.
      preferred_element_type: output dtype; None: the operands' dtype. The
        partial products travel in it and are summed in fp32.
      mechanism: "auto"/"chunked" (a GEMM per row chunk, each peer's chunk
        written straight into its memory by the GEMM's epilogue; bf16/fp16
        operands, K and N multiples of 8) or "xla".
      fp8: None, or an FP8 recipe (as for all_gather_matmul): the partial
        products come from pk's FP8 GEMM and are reduce-scattered in the
        output dtype (fp32 sums); the backward gathers dy in FP8.
      fp8_scales: delayed scaling's scales (as for all_gather_matmul): the
        result is then (out, (amax_x, amax_w)).

    Returns:
      This device's shard of the sum, [x.shape[0] / n, ..., N]; with
      fp8_scales (out, amaxes).
    """
    x, w, fp8_path = _operands(x, w, fp8, fp8_scales)
    cfg = _validate("matmul_reduce_scatter", *_checked_as(x, w), axis_name,
                    preferred_element_type, "xla" if fp8_path else mechanism)
    if x.shape[0] % cfg.n:
        raise ValueError(f"pk_jax.matmul_reduce_scatter: the first dim of x ({x.shape[0]}) "
                         f"must divide by the size of axis {cfg.names} ({cfg.n})")
    if fp8_path:
        rows = int(np.prod(x.shape[:-1])) // cfg.n
        out, amaxes, _ = _fp8_call("matmul_reduce_scatter",
                                   tp_matmul_fp8.matmul_reduce_scatter, x, w, axis_name, fp8,
                                   fp8_scales, preferred_element_type, mechanism, rows)
        return _fp8_result(out, amaxes,
                           (x.shape[0] // cfg.n,) + x.shape[1:-1] + (w.shape[1],))
    x2 = make_varying(x.reshape(-1, x.shape[-1]), cfg.names)
    w = make_varying(w, cfg.names)
    out = _rs(x2, w, cfg)
    return out.reshape((x.shape[0] // cfg.n,) + x.shape[1:-1] + (w.shape[1],))


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name: str | Sequence[str], *,
                      preferred_element_type=None, mechanism: str = "auto",
                      fp8=None, fp8_scales=None):
    """`lax.psum(x @ w, axis_name)`, fused; every rank gets the same bits.

    Call inside `jax.shard_map`, e.g. for the output of a row-parallel layer
    without sequence parallelism, or a tensor-parallel decode step. Like
    `lax.psum`, the result is invariant over `axis_name` (shard_map's
    check_vma) and its gradient is psum's: every rank gets the full
    cotangent dy, dx = dy @ w^T and dw = x^T @ dy (no collective).

    Args:
      x: [M, K_local] or [batch..., K_local], this device's share of the
        contraction (e.g. a column-parallel layer's output).
      w: [K_local, N], the row shard of the weight, or an `Fp8Weight` (as
        for all_gather_matmul).
      axis_name: mesh axis (or tuple of axes) to sum over.
      preferred_element_type: output dtype; None: the operands' dtype. The
        partial products travel in it and are summed in fp32, each output
        element once, in one fixed order.
      mechanism: "auto" (pk_jax/tuning.py, by M), "chunked" (M divisible by
        the axis size: the reduce-scatter of the partials overlapped with
        the GEMMs, as matmul_reduce_scatter, then the reduced chunks
        exchanged by the copy engines), "one_shot" (for decode-sized M: each
        rank's partial pushed to every peer and summed by every rank) or
        "xla" (dot + psum). The kernels take bf16/fp16 operands, K and N
        multiples of 8; other inputs take XLA (a one-time warning under
        "auto" on GPUs, a ValueError when a kernel mechanism is forced).
      fp8: None, or an FP8 recipe (as for all_gather_matmul): the partial
        product from pk's FP8 GEMM, summed by pk's all_reduce.
      fp8_scales: delayed scaling's scales (as for all_gather_matmul): the
        result is then (out, (amax_x, amax_w)).

    Returns:
      The sum, [*x.shape[:-1], N], replicated over `axis_name`; with
      fp8_scales (out, amaxes).
    """
    x, w, fp8_path = _operands(x, w, fp8, fp8_scales)
    rows = int(np.prod(x.shape[:-1])) if x.ndim >= 2 else 0
    if fp8_path:
        out, amaxes, _ = _fp8_call("matmul_all_reduce", tp_matmul_fp8.matmul_all_reduce, x, w,
                                   axis_name, fp8, fp8_scales, preferred_element_type,
                                   mechanism, rows)
        return _fp8_result(out, amaxes, x.shape[:-1] + (w.shape[1],))
    cfg = _validate("matmul_all_reduce", x, w, axis_name, preferred_element_type, mechanism,
                    ALL_REDUCE_MECHANISMS,
                    lambda n: tuning.matmul_all_reduce_mechanism(rows, n))
    if cfg.mechanism == "chunked" and rows % cfg.n:
        raise ValueError(f"pk_jax.matmul_all_reduce(mechanism='chunked'): the rows of x "
                         f"({rows}, x {x.shape}) must divide by the size of axis {cfg.names} "
                         f"({cfg.n}); use 'one_shot' or 'auto'")
    x2 = make_varying(x.reshape(-1, x.shape[-1]), cfg.names)
    w = make_varying(w, cfg.names)
    return _ar(x2, w, cfg).reshape(x.shape[:-1] + (w.shape[1],))
