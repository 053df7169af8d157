// Instantiation: FP8 e4m3 x e4m3 -> bf16, block factors.
#include "kernels/gemm/gemm_fp8_sm90.cuh"

template struct pk::gemm::Fp8Variant<pk::DType::kE4M3, pk::DType::kE4M3, pk::DType::kBF16,
                                     pk::gemm::Scaling::kBlock>;
