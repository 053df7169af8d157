// Type dispatch over the per-type instantiations (gemm_<in>_<out>.cu).
#include "kernels/gemm/gemm.h"

namespace pk::gemm {

#ifdef PK_HAVE_CUTLASS
cudaError_t run_bf16_bf16(const Problem&, const Device&, cudaStream_t);
cudaError_t run_bf16_f32(const Problem&, const Device&, cudaStream_t);
cudaError_t run_f16_f16(const Problem&, const Device&, cudaStream_t);
cudaError_t run_f16_f32(const Problem&, const Device&, cudaStream_t);
cudaError_t load_bf16_bf16();
cudaError_t load_bf16_f32();
cudaError_t load_f16_f16();
cudaError_t load_f16_f32();
#endif

cudaError_t load_kernels() {
#ifdef PK_HAVE_CUTLASS
  for (auto load : {load_bf16_bf16, load_bf16_f32, load_f16_f16, load_f16_f32})
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
                     (p.out == p.in || p.out == DType::kF32);
  const int64_t limit = int64_t(1) << 31;
  return types && p.m > 0 && p.n > 0 && p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0 &&
         p.m < limit && p.n < limit && p.k < limit;
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
#ifdef PK_HAVE_CUTLASS
  const bool f32 = p.out == DType::kF32;
  if (p.in == DType::kBF16) return f32 ? run_bf16_f32(p, dev, stream) : run_bf16_bf16(p, dev, stream);
  return f32 ? run_f16_f32(p, dev, stream) : run_f16_f16(p, dev, stream);
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace pk::gemm
