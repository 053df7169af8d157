// Dispatch over the fused matmul_reduce_scatter instantiations
// (fused_rs_<type>[_bt].cu), and their loading at init.
#include "kernels/tp_matmul/tp_matmul.h"

namespace pk::tp_matmul {

#ifdef PK_HAVE_CUTLASS
#define PK_FUSED_RS_INSTANTIATIONS(X) X(bf16) X(f16) X(bf16_bt) X(f16_bt)
#define PK_FUSED_RS_DECLARE(name)                                                      \
  cudaError_t run_fused_rs_##name(const Params&, const ScatterTarget&, cudaStream_t); \
  cudaError_t load_fused_rs_##name();
PK_FUSED_RS_INSTANTIATIONS(PK_FUSED_RS_DECLARE)
#undef PK_FUSED_RS_DECLARE
#endif

cudaError_t run_fused_rs(const Params& p, const ScatterTarget& t, cudaStream_t s) {
  if (!fused_rs_supported(p)) return cudaErrorNotSupported;
#ifdef PK_HAVE_CUTLASS
  const bool bf16 = p.in == gemm::DType::kBF16;
  if (p.w_transposed) return bf16 ? run_fused_rs_bf16_bt(p, t, s) : run_fused_rs_f16_bt(p, t, s);
  return bf16 ? run_fused_rs_bf16(p, t, s) : run_fused_rs_f16(p, t, s);
#else
  return cudaErrorNotSupported;
#endif
}

cudaError_t load_fused_rs_kernels() {
#ifdef PK_HAVE_CUTLASS
#define PK_FUSED_RS_LOAD(name) load_fused_rs_##name,
  return gemm::load_each({PK_FUSED_RS_INSTANTIATIONS(PK_FUSED_RS_LOAD)});
#undef PK_FUSED_RS_LOAD
#else
  return cudaSuccess;
#endif
}

}  // namespace pk::tp_matmul
