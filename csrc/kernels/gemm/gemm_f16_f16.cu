// Instantiation: f16 inputs, f16 output.
#include "kernels/gemm/gemm_sm90.cuh"

PK_GEMM_INSTANTIATION(f16_f16, cutlass::half_t, cutlass::half_t, cutlass::layout::RowMajor)
