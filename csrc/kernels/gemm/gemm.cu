// Dispatch over the instantiations (gemm_<in>_<out>[_bt].cu).
#include "kernels/gemm/gemm.h"

namespace pk::gemm {

#ifdef PK_HAVE_CUTLASS
#define PK_GEMM_DECLARE(name)                                              \
  cudaError_t run_##name(const Problem&, const Device&, cudaStream_t); \
  cudaError_t load_##name();
PK_GEMM_DECLARE(bf16_bf16)
PK_GEMM_DECLARE(bf16_f32)
PK_GEMM_DECLARE(f16_f16)
PK_GEMM_DECLARE(f16_f32)
PK_GEMM_DECLARE(bf16_bf16_bt)
PK_GEMM_DECLARE(f16_f16_bt)
#undef PK_GEMM_DECLARE
#endif

cudaError_t load_kernels() {
#ifdef PK_HAVE_CUTLASS
  for (auto load : {load_bf16_bf16, load_bf16_f32, load_f16_f16, load_f16_f32, load_bf16_bf16_bt,
                    load_f16_f16_bt})
    if (cudaError_t e = load(); e != cudaSuccess) return e;
#endif
  return cudaSuccess;
}

bool available() {
#ifdef PK_HAVE_CUTLASS
  return true;
#else
  return false;
#endif
}

bool supported(const Problem& p) {
  const bool types = (p.in == DType::kBF16 || p.in == DType::kF16) &&
                     (p.out == p.in || (p.out == DType::kF32 && !p.b_transposed));
  const int64_t limit = int64_t(1) << 31;
  return types && p.m > 0 && p.n > 0 && p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0 &&
         p.m < limit && p.n < limit && p.k < limit;
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
#ifdef PK_HAVE_CUTLASS
  const bool bf16 = p.in == DType::kBF16;
  if (p.b_transposed) return bf16 ? run_bf16_bf16_bt(p, dev, stream) : run_f16_f16_bt(p, dev, stream);
  if (p.out == DType::kF32) return bf16 ? run_bf16_f32(p, dev, stream) : run_f16_f32(p, dev, stream);
  return bf16 ? run_bf16_bf16(p, dev, stream) : run_f16_f16(p, dev, stream);
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace pk::gemm
