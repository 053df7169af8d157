// Instantiation: bf16 inputs, bf16 output, B given transposed.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(bf16_bf16_bt, cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor)
