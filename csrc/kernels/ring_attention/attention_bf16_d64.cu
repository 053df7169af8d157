// Fused ring attention kernel, bf16 inputs, head dim 64.
#include "kernels/ring_attention/attention_sm90.cuh"

PK_RING_ATTENTION_INSTANTIATE(cutlass::bfloat16_t, 64)
