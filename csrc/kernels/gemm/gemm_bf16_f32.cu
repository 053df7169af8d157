// Instantiation: bf16 inputs, f32 output.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(bf16_f32, cutlass::bfloat16_t, float, cutlass::layout::RowMajor)
