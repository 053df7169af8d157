"""pk_jax.ring_attention: api.py (the op: validation, mechanism, the backward's
schedule), zigzag.py (zigzag_shard / zigzag_unshard), cudnn.py (the ring of
cuDNN blocks, no primitive); not public API: primitive.py (the fused forward
and RingConfig), bwd_primitive.py (the ring backward: the fused kernel, the
XLA-collective ring), attention_bwd_primitive.py (one ring step's block
gradients)."""

from pk_jax.ops.ring_attention.api import (LAYOUTS, MECHANISMS, check_qkv_arrays, check_scale,
                                           ring_attention)
from pk_jax.ops.ring_attention.zigzag import zigzag_shard, zigzag_unshard

__all__ = ["LAYOUTS", "MECHANISMS", "check_qkv_arrays", "check_scale", "ring_attention",
           "zigzag_shard", "zigzag_unshard"]
