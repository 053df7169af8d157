// Block backward kernel, bf16 inputs, head dim 128.
#ifdef PK_HAVE_CUTLASS
#include "kernels/attention_bwd/attention_bwd_sm90.cuh"

PK_ATTENTION_BWD_INSTANTIATE(cutlass::bfloat16_t, 128)
#endif
