// Dispatch over the instantiations (gemm_<in>_<out>[_bt].cu).
#include "kernels/gemm/gemm.h"

namespace pk::gemm {

#ifdef PK_HAVE_CUTLASS
// Every instantiation (gemm_<name>.cu), declared and loaded from this one list.
#define PK_GEMM_INSTANTIATIONS(X) \
  X(bf16_bf16) X(bf16_f32) X(f16_f16) X(f16_f32) X(bf16_bf16_bt) X(f16_f16_bt)
#define PK_GEMM_DECLARE(name)                                          \
  cudaError_t run_##name(const Problem&, const Device&, cudaStream_t); \
  cudaError_t load_##name();
PK_GEMM_INSTANTIATIONS(PK_GEMM_DECLARE)
#undef PK_GEMM_DECLARE
#endif

cudaError_t load_kernels() {
#ifdef PK_HAVE_CUTLASS
#define PK_GEMM_LOAD(name) load_##name,
  return gemm::load_each({PK_GEMM_INSTANTIATIONS(PK_GEMM_LOAD)});
#undef PK_GEMM_LOAD
#else
  return cudaSuccess;
#endif
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
