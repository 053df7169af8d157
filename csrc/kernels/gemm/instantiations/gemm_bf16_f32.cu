// Instantiation: bf16 inputs, f32 output.
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kBF16, pk::gemm::DType::kF32, false>;
