"""pk_jax.all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce:
api.py (the ops), fp8.py (their fp8= paths), primitive.py (their primitives
and FFI lowerings; not public API)."""

from pk_jax.ops.tp_matmul.api import (ALL_REDUCE_MECHANISMS, MECHANISMS, all_gather_matmul,
                                      matmul_all_reduce, matmul_reduce_scatter)

__all__ = ["ALL_REDUCE_MECHANISMS", "MECHANISMS", "all_gather_matmul", "matmul_all_reduce",
           "matmul_reduce_scatter"]
