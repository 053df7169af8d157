"""pk_jax.all_reduce and pk_jax.reduce_scatter: api.py (the ops), primitive.py
(their primitive and FFI lowering; not public API)."""

from pk_jax.ops.all_reduce.api import (DEPRECATED_MECHANISMS, KERNEL_DTYPES, MECHANISMS,
                                       all_reduce, reduce_scatter)

__all__ = ["DEPRECATED_MECHANISMS", "KERNEL_DTYPES", "MECHANISMS", "all_reduce", "reduce_scatter"]
