// Instantiation: fused matmul_reduce_scatter, fp16 B [N, K] (w^T read in place).
#include "kernels/tp_matmul/fused_rs_sm90.cuh"

PK_FUSED_RS_INSTANTIATION(f16_bt, cutlass::half_t, cutlass::layout::ColumnMajor)
