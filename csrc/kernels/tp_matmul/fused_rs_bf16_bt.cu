// Instantiation: fused matmul_reduce_scatter, bf16 B [N, K] (w^T read in place).
#include "kernels/tp_matmul/fused_rs_sm90.cuh"

PK_FUSED_RS_INSTANTIATION(bf16_bt, cutlass::bfloat16_t, cutlass::layout::ColumnMajor)
