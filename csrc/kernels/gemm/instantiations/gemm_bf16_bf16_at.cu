// Instantiation: bf16 inputs, bf16 output, A given transposed (weight gradients).
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kBF16, pk::gemm::DType::kBF16, false, true>;
