// Instantiation: FP8 e4m3 x e4m3 -> f32, block factors.
#include "kernels/gemm/gemm_fp8_sm90.cuh"

template struct pk::gemm::Fp8Variant<pk::DType::kE4M3, pk::DType::kE4M3, pk::DType::kF32,
                                     pk::gemm::Scaling::kBlock>;
