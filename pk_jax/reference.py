"""Pure-lax implementations: the CPU path, the fallback, and the test oracle.

Each function has exactly the semantics of the matching pk_jax op.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax import lax


def all_gather(x: jax.Array, axis_name: str | Sequence[str], *, axis: int = 0,
               tiled: bool = False) -> jax.Array:
    """`lax.all_gather` (XLA's collective; NCCL on GPUs)."""
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
