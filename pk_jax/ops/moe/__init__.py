"""pk_jax.moe_dispatch / pk_jax.moe_combine: api.py (the ops), primitive.py
(the exchange and layout primitives and their FFI lowerings; not public
API)."""

from pk_jax.ops.moe.api import (MECHANISMS, MoeConfig, MoeLayout, moe_combine, moe_dispatch,
                                segment_of)

__all__ = ["MECHANISMS", "MoeConfig", "MoeLayout", "moe_combine", "moe_dispatch", "segment_of"]
