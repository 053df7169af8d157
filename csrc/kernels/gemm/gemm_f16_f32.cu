// Instantiation: f16 inputs, f32 output.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(f16_f32, cutlass::half_t, float, cutlass::layout::RowMajor)
