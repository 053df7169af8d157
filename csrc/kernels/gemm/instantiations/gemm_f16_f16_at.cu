// Instantiation: f16 inputs, f16 output, A given transposed (weight gradients).
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kF16, pk::gemm::DType::kF16, false, true>;
