// Instantiation: bf16 inputs, bf16 output.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(bf16_bf16, cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::RowMajor)
