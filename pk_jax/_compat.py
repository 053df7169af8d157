"""Small shims over JAX internals that differ between supported versions
(jax 0.10.2 on CPU machines, 0.11.x on the GPU machines)."""

from __future__ import annotations

import jax


def make_varying(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Mark `x` as varying over `names` where it is not yet, as XLA's own
    collectives do before binding (shard_map's check_vma type system)."""
    try:
        from jax._src.lax.parallel import insert_collective_pvary
    except ImportError:  # older/newer JAX without the helper: nothing to do
        return x
    return insert_collective_pvary(names, x)
