"""Inputs and a dense reference for pk_jax.grouped_matmul's CPU and GPU tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# (M, K, N, group sizes): ragged groups, an empty group, one group holding
# every row, rows past the sum, a negative size, a sum past M (cut).
CASES = [
    (96, 64, 48, [10, 0, 30, 5]),
    (64, 32, 16, [0, 64, 0]),
    (200, 128, 72, [3, 1, 150, 7, 0, 2]),
    (40, 16, 8, [-5, 12, 100]),
    (1, 8, 8, [1]),
]


def dense(x, w, sizes):
    """Every row through its group's matrix, in float64; rows past the
    groups' (clamped) sum are zeros."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    at = 0
    for g, s in enumerate(sizes):
        s = min(max(int(s), 0), x.shape[0] - at)
        out[at:at + s] = x[at:at + s] @ w[g]
        at += s
    return out


def dense_grads(x, w, sizes, t):
    """d/dx and d/dw of sum(dense(x, w, sizes) * t), float64."""
    x, w, t = (np.asarray(a, np.float64) for a in (x, w, t))
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    at = 0
    for g, s in enumerate(sizes):
        s = min(max(int(s), 0), x.shape[0] - at)
        dx[at:at + s] = t[at:at + s] @ w[g].T
        dw[g] = x[at:at + s].T @ t[at:at + s]
        at += s
    return dx, dw


def inputs(rng, m, k, n, g, dtype):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    # The cotangent exact in bf16: the gradient kernels take it in the operands' type.
    t = np.asarray(rng.standard_normal((m, n)).astype(jnp.bfloat16), np.float32)
    return x.astype(dtype), w.astype(dtype), t
