"""Plain-`jax.jit` entry points partitioned by pk_jax: sharding rules
(`jax.experimental.custom_partitioning`, Shardy or GSPMD) that run the fused
ops when the operands' shardings call for their collectives.

    y = pk_jax.dot_general(x, w, (((2,), (0,)), ((), ())))  # x, w: sharded arrays
    o = pk_jax.dot_product_attention(q, k, v, causal=True)  # seq-sharded q/k/v

`record_routes()` shows which route each compiled op took.
"""

from pk_jax.partitioning._specs import Route, record_routes
from pk_jax.partitioning.attention import dot_product_attention
from pk_jax.partitioning.dot import dot_general, matmul

__all__ = ["Route", "dot_general", "dot_product_attention", "matmul", "record_routes"]
