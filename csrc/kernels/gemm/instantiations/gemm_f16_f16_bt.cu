// Instantiation: f16 inputs, f16 output, B given transposed.
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kF16, pk::gemm::DType::kF16, true>;
