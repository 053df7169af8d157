"""pk_jax.all_reduce and pk_jax.reduce_scatter: `lax.psum` and
`lax.psum_scatter` with pk's peer-memory kernels on GPUs.

Validation and the mechanism happen here, once, at trace time: dtypes with
no kernel and mechanism="xla" call lax; everything else binds the primitive
(primitive.py) with one frozen config, which lowers to the kernels
on CUDA and to lax on every other platform.

Every rank gets bitwise identical results: each element is summed over ranks
0..n-1 in that order (fp32 accumulation for bf16/fp16, rounded once), by one
rank (two-shot) or by every rank with the same instructions (one-shot).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import jax
import numpy as np
from jax import lax

from pk_jax import _args, groups, reference, runtime, tuning
from pk_jax._compat import make_varying, vary_alike, varying_axes
from pk_jax._warnings import warn_once
from pk_jax.ops.all_reduce.primitive import (KERNEL_MECHANISMS, AllReduceConfig, all_reduce_p)

MECHANISMS = ("auto", *KERNEL_MECHANISMS, "xla")
# Earlier spellings, still accepted with a DeprecationWarning.
DEPRECATED_MECHANISMS = {"ld_st_oneshot": "one_shot"}
KERNEL_DTYPES = (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16), np.dtype(np.float32),
                 np.dtype(np.int32))


def _kernel_dtype(op: str, x: jax.Array, mechanism: str) -> bool:
    """Whether x's dtype has a kernel; if not, warn once (where a kernel
    could have run) and let the caller take lax."""
    if np.dtype(x.dtype) in KERNEL_DTYPES and not jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.extended):
        return True
    if runtime.available():  # elsewhere the reference is the plan, not a fallback
        warn_once(f"{op}-dtype-{x.dtype}",
                  f"pk_jax.{op}: dtype {x.dtype} has no kernel (supported: bfloat16, float16, "
                  f"float32, int32); using lax (mechanism={mechanism!r} ignored)")
    return False


def _check_mechanism(op: str, mechanism) -> str:
    """The mechanism's current spelling; ValueError for an unknown one."""
    if isinstance(mechanism, str) and mechanism in DEPRECATED_MECHANISMS:
        new = DEPRECATED_MECHANISMS[mechanism]
        warnings.warn(f"pk_jax.{op}: mechanism {mechanism!r} is deprecated, use {new!r}",
                      DeprecationWarning, stacklevel=3)
        return new
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.{op}: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    return mechanism


def _bind(x, cfg_kwargs: dict, mechanism: str, per_rank_bytes: int, names, kind: str):
    chosen = (tuning.all_reduce_mechanism(kind, per_rank_bytes) if mechanism == "auto"
              else mechanism)
    assert chosen in KERNEL_MECHANISMS, chosen
    n = lax.axis_size(names)
    x = make_varying(x, names)
    # Under shard_map's type checks x now varies over every summed axis; unchecked, over none.
    check_vma = set(names) <= varying_axes(x)
    cfg = AllReduceConfig(kind=kind, names=names, n=n, mechanism=chosen,
                          forced=mechanism != "auto", check_vma=check_vma, **cfg_kwargs)
    return all_reduce_p.bind(x, cfg=cfg)


def all_reduce(x: jax.Array, axis_name: str | Sequence[str], *,
               mechanism: str = "auto") -> jax.Array:
    """Sum `x` over every device of `axis_name`; the semantics of
    `jax.lax.psum(x, axis_name)` (result type, varying axes and gradient).

    Call inside `jax.shard_map`. On CUDA GPUs the data moves through pk_jax
    kernels that write into the peers' workspaces; elsewhere XLA's
    collective runs.

    Every rank gets bitwise identical results: each element is the sum over
    ranks 0, 1, ..., n-1 in that order, accumulated in fp32 for bfloat16 and
    float16 and rounded once (XLA's psum may round differently, so results
    can differ from it in the last bit), in the type itself for float32 and
    int32 (wrapping). Every kernel mechanism gives the same bits.

    Args:
      x: this device's operand. bfloat16, float16, float32 and int32 take
        the kernels; other dtypes take `lax.psum` with a one-time
        `PkJaxFallbackWarning` (where a kernel could have run).
      axis_name: mesh axis name, or tuple of names, to sum over.
      mechanism: "auto" (pk_jax/tuning.py; provisional until measured:
        "one_shot" up to 256 KiB per rank, "two_shot" above);
        "one_shot" (an SM kernel stores x into every peer's workspace,
        each rank reduces all n blocks: one exchange, n x the bytes);
        "two_shot" (reduce-scatter into the owner of each 1/n chunk, then
        all-gather of the reduced chunks; ld/st pushes); "copy_engine" (the
        two-shot schedule with copy-engine pushes, a reduction kernel only);
        or "xla" (lax.psum). "ld_st_oneshot", the earlier name of
        "one_shot", still works with a DeprecationWarning.

    Returns:
      The sum, of x's shape and dtype, identical on every device of the group
      (a pytree of arrays gives the pytree of their sums, as lax.psum).
    """
    mechanism = _check_mechanism("all_reduce", mechanism)
    names = groups.axis_names(axis_name, "all_reduce")
    return jax.tree.map(lambda leaf: _all_reduce_leaf(leaf, names, mechanism), x)


def _all_reduce_leaf(x, names, mechanism: str) -> jax.Array:
    x = jax.numpy.asarray(x)
    if mechanism == "xla" or x.size == 0 or not _kernel_dtype("all_reduce", x, mechanism):
        return reference.all_reduce(x, names)
    return _bind(x, {}, mechanism, x.size * x.dtype.itemsize, names, "all_reduce")


def reduce_scatter(x: jax.Array, axis_name: str | Sequence[str], *, scatter_dimension: int = 0,
                   tiled: bool = True, mechanism: str = "auto") -> jax.Array:
    """Sum `x` over `axis_name` and keep this device's chunk; the semantics of
    `jax.lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)`.

    Call inside `jax.shard_map`. Rank r (`lax.axis_index(axis_name)`) gets
    chunk r of `scatter_dimension`. Summation order and dtypes as
    `pk_jax.all_reduce`: bitwise reproducible, fp32 accumulation for 16-bit
    floats.

    Args:
      x: this device's operand.
      axis_name: mesh axis name, or tuple of names.
      scatter_dimension: the dimension split into n chunks.
      tiled: True: the dimension shrinks n-fold (its size must be a multiple
        of n); False: its size must be n and it is removed. (Note: the
        default differs from lax.psum_scatter's tiled=False: the tiled form
        is what tensor-parallel layers use.)
      mechanism: "auto" (provisional: "two_shot"), "one_shot" or
        "two_shot" (both: an SM kernel stores chunk q into rank q's
        workspace, rank q reduces its chunk), "copy_engine" (the copy
        engines push the chunks), or "xla" (lax.psum_scatter);
        "ld_st_oneshot" as in all_reduce.

    An empty x (a zero-size dimension anywhere, also the scattered one)
    gives the empty chunk of the right shape.

    Returns:
      This device's chunk of the sum (a pytree of arrays: the pytree of
      their chunks).
    """
    mechanism = _check_mechanism("reduce_scatter", mechanism)
    names = groups.axis_names(axis_name, "reduce_scatter")
    return jax.tree.map(
        lambda leaf: _reduce_scatter_leaf(leaf, names, scatter_dimension, tiled, mechanism), x)


def _reduce_scatter_leaf(x, names, scatter_dimension, tiled, mechanism: str) -> jax.Array:
    x = jax.numpy.asarray(x)
    tiled = _args.boolean("reduce_scatter", "tiled", tiled)
    dim = _args.axis("reduce_scatter", "scatter_dimension", scatter_dimension, x.ndim,
                     f"x of shape {x.shape}")
    n = lax.axis_size(names)
    size = x.shape[dim]
    if tiled and size % n != 0:
        raise ValueError(f"pk_jax.reduce_scatter: x's dimension scatter_dimension={dim} has size "
                         f"{size}, not a multiple of the axis size {n} (tiled=True)")
    if not tiled and size != n:
        raise ValueError(f"pk_jax.reduce_scatter: x's dimension scatter_dimension={dim} has size "
                         f"{size}; tiled=False needs the axis size {n}")
    if x.size == 0:  # nothing to sum (lax's collective refuses some empty shapes)
        shape = list(x.shape)
        if tiled:
            shape[dim] //= n
        else:
            del shape[dim]
        return vary_alike(jax.numpy.zeros(shape, x.dtype), x, names=names)[0]
    if mechanism == "xla" or not _kernel_dtype("reduce_scatter", x, mechanism):
        return reference.reduce_scatter(x, names, scatter_dimension=dim, tiled=tiled)
    return _bind(x, dict(scatter_dimension=dim, tiled=tiled), mechanism,
                 x.size * x.dtype.itemsize, names, "reduce_scatter")
