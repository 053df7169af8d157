// Instantiation: FP8 e4m3 x e5m2 -> bf16, tensor factors.
#include "kernels/gemm/gemm_fp8_sm90.cuh"

template struct pk::gemm::Fp8Variant<pk::DType::kE4M3, pk::DType::kE5M2, pk::DType::kBF16,
                                     pk::gemm::Scaling::kTensor>;
