// Instantiation: fused matmul_reduce_scatter, fp16 B [K, N].
#include "kernels/tp_matmul/fused_rs_sm90.cuh"

PK_FUSED_RS_INSTANTIATION(f16, cutlass::half_t, cutlass::layout::RowMajor)
