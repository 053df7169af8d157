// Instantiation: bf16 inputs, bf16 output, B given transposed.
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kBF16, pk::gemm::DType::kBF16, true>;
