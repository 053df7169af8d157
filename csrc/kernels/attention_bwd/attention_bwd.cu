// Host side of the block backward: checks and the dispatch to the kernel
// instantiations (attention_bwd_sm90.cuh).
//
// Launch: cudaMemsetAsync(dq, 0) then one kernel on the caller's stream;
// no workspace (dq itself is the fp32 accumulator of the TMA reduce-adds).
#include "kernels/attention_bwd/attention_bwd.h"

#include "kernels/gemm/gemm.h"
#include "pk/cuda_check.h"

#include "kernels/common/variants.h"

namespace pk::attention_bwd {
namespace {

#ifdef PK_HAVE_CUTLASS
using Instantiations =
    variants::Variants<Variant<DType::kBF16, 128>, Variant<DType::kBF16, 64>,
                       Variant<DType::kF16, 128>, Variant<DType::kF16, 64>>;
#endif

}  // namespace

// The kernel needs the CUTLASS headers, like the GEMM: one build switch.
bool available() { return gemm::available(); }

bool supported(const Params& p) {
  if (!available() || (p.head_dim != 64 && p.head_dim != 128)) return false;
  if (p.batch <= 0 || p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0 || p.n < 1) return false;
  // A tile's rows are consecutive tokens: zigzag tiles stay inside a chunk.
  const int chunks = p.zigzag ? 2 : 1;
  const int tq = tile_q(p.head_dim) * chunks, tkv = kTileKv * chunks;
  return p.s_q > 0 && p.s_kv > 0 && p.s_q % tq == 0 && p.s_kv % tkv == 0;
}

cudaError_t run(const Params& p) {
#ifdef PK_HAVE_CUTLASS
  if (!supported(p)) return cudaErrorNotSupported;
  PK_CUDA_TRY(cudaMemsetAsync(p.dq, 0, size_t(p.batch) * p.s_q * p.q_heads * p.head_dim * sizeof(float),
                              p.stream));
  return Instantiations::launch(VariantKey{p.dtype, p.head_dim}, p);
#else
  (void)p;
  return cudaErrorNotSupported;
#endif
}

cudaError_t load_kernels() {
#ifdef PK_HAVE_CUTLASS
  return Instantiations::load();
#else
  return cudaSuccess;
#endif
}

}  // namespace pk::attention_bwd
