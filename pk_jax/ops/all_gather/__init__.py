"""pk_jax.all_gather: api.py (the op), primitive.py (its primitive and FFI
lowering; not public API)."""

from pk_jax.ops.all_gather.api import MECHANISMS, all_gather

__all__ = ["MECHANISMS", "all_gather"]
