// Instantiation: FP8 e5m2 x e4m3 -> f32, tensor factors.
#include "kernels/gemm/gemm_fp8_sm90.cuh"

template struct pk::gemm::Fp8Variant<pk::DType::kE5M2, pk::DType::kE4M3, pk::DType::kF32,
                                     pk::gemm::Scaling::kTensor>;
