// Instantiation: f16 inputs, f16 output, B given transposed.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(f16_f16_bt, cutlass::half_t, cutlass::half_t, cutlass::layout::ColumnMajor)
