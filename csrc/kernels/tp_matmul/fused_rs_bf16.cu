// Instantiation: fused matmul_reduce_scatter, bf16 B [K, N].
#include "kernels/tp_matmul/fused_rs_sm90.cuh"

PK_FUSED_RS_INSTANTIATION(bf16, cutlass::bfloat16_t, cutlass::layout::RowMajor)
