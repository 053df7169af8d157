"""pk_jax.all_to_all: `lax.all_to_all` semantics, validated once.

Only the XLA mechanism exists so far (`auto` resolves to it everywhere):
the op is the place where pk's peer-memory all-to-all kernel will plug in,
and the dense exchange that pk_jax.moe_dispatch's pure-JAX path uses.
Gradients are those of `lax.all_to_all` (the transpose swaps the split and
concat axes).
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax import lax

from pk_jax import _args, groups

MECHANISMS = ("auto", "xla")


def all_to_all(x: jax.Array, axis_name: str | Sequence[str], split_axis: int,
               concat_axis: int, *, tiled: bool = False,
               mechanism: str = "auto") -> jax.Array:
    """Split `x` along `split_axis` into one block per device of `axis_name`,
    send block r to device r and concatenate what arrives along
    `concat_axis`; same semantics as `jax.lax.all_to_all(x, axis_name,
    split_axis, concat_axis, tiled=tiled)`.

    Call inside `jax.shard_map`.

    Args:
      x: this device's array; `x.shape[split_axis]` must equal the number n
        of devices of `axis_name` (tiled=False) or be divisible by it
        (tiled=True).
      axis_name: mesh axis name, or tuple of names (row-major order).
      split_axis: the axis split into blocks.
      concat_axis: the axis along which the received blocks are stacked.
      tiled: False: the split axis (of size n) is consumed and a new axis of
        the n received blocks appears at `concat_axis`, as in
        `lax.all_to_all`; True: `split_axis` shrinks n-fold and
        `concat_axis` grows n-fold.
      mechanism: "auto" or "xla" (`lax.all_to_all`; the only mechanism so
        far, what "auto" takes on every platform).

    Returns:
      The exchanged array.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"pk_jax.all_to_all: mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}")
    names = groups.axis_names(axis_name, "all_to_all")
    x = jax.numpy.asarray(x)
    if x.ndim == 0:
        raise ValueError("pk_jax.all_to_all: needs an input of rank >= 1")
    split, concat = (_args.axis("all_to_all", what, ax, x.ndim, f"a rank-{x.ndim} input")
                     for what, ax in (("split_axis", split_axis), ("concat_axis", concat_axis)))
    tiled = _args.boolean("all_to_all", "tiled", tiled)
    n = lax.axis_size(names)
    if (x.shape[split] % n) if tiled else (x.shape[split] != n):
        need = "divisible by" if tiled else "equal to (tiled=False)"
        raise ValueError(f"pk_jax.all_to_all: split axis {split} of size {x.shape[split]} is "
                         f"not {need} the {n} devices of {names}")
    axes = names[0] if len(names) == 1 else names
    return lax.all_to_all(x, axes, split, concat, tiled=tiled)
