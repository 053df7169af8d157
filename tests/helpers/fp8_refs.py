"""Float32 references of FP8 products with block factors (fp8="block"): the
operands quantized by pk's quantizer and dequantized, multiplied in float32.
An FP8 GEMM with block factors computes the same up to the order of its fp32
sums and the rounding of its output, so the references bound a result far
tighter than the unquantized product does (a factor applied to the wrong
rows shows). Each operand is quantized as a whole: where every shard's
extents are multiples of 128, a shard's 1x128, 128x1 and 128x128 blocks are
the whole's, so the tensor-parallel ops' products have the same reference as
the unsharded one. Call on the host's CPU device (the references' numerics).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pk_jax
from pk_jax.ops.fp8 import primitive as prim


def dequantized(a, granularity: str) -> np.ndarray:
    """a [R, C] quantized to e4m3 with block factors ("rows": per 1x128,
    "cols": per 128x1, "blocks": per 128x128) and dequantized (float32)."""
    a = jnp.asarray(a, jnp.float32)
    if granularity == "rows":
        q, _, f, _ = pk_jax.fp8_quantize(a, "rows")
        return np.asarray(prim.dequantize(q, f, "block"))
    _, qt, f, _ = pk_jax.fp8_quantize(a, granularity, rowwise=False, transposed=True)
    return np.asarray(prim.dequantize(qt, f, "block", row_blocks=granularity == "cols")).T


def block_products(x, w, dy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, dx, dw) of y = x @ w with fp8="block", x [M, K], w [K, N], dy [M, N]
    (the output's cotangent): y from x per 1x128 and w per 128x128, dx from
    dy per 1x128 and w, dw from x and dy per 128x1 (along the tokens)."""
    wq = dequantized(w, "blocks")
    return (dequantized(x, "rows") @ wq, dequantized(dy, "rows") @ wq.T,
            dequantized(x, "cols").T @ dequantized(dy, "cols"))
