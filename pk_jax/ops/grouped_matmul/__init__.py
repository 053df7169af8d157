"""pk_jax.grouped_matmul: api.py (the op), primitive.py (its primitive and FFI
lowering; not public API)."""

from pk_jax.ops.grouped_matmul.api import MECHANISMS, grouped_matmul

__all__ = ["MECHANISMS", "grouped_matmul"]
