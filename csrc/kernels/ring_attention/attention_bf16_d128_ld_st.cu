// Fused ring attention kernel, mechanism ld_st (communicator CTAs), bf16 inputs,
// head dim 128.
#include "kernels/ring_attention/attention_sm90.cuh"

PK_RING_ATTENTION_LD_ST_INSTANTIATE(cutlass::bfloat16_t, 128)
