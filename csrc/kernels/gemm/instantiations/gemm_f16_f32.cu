// Instantiation: f16 inputs, f32 output.
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kF16, pk::gemm::DType::kF32, false>;
