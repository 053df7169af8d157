// Host side of the block backward: checks and the dispatch to the kernel
// instantiations (attention_bwd_sm90.cuh).
//
// Launch: dq = 0 (a fill kernel; NaN while the device holds an error, so
// the reduce-adds keep a failed call's dq poison) then one kernel on the
// caller's stream; no workspace (dq itself is the fp32 accumulator of the
// TMA reduce-adds).
#include "kernels/attention_bwd/attention_bwd.h"

#include <algorithm>

#include "kernels/gemm/gemm.h"
#include "pk/cuda_check.h"
#include "pk/sync.cuh"

#include "kernels/common/variants.h"

namespace pk::attention_bwd {
namespace {

constexpr int kFillThreads = 256;

// dq = 0, or all bits set (NaN) while the device holds an error: one load of
// the claim word per CTA.
__global__ void __launch_bounds__(kFillThreads) init_dq_kernel(float* dq, uint64_t bytes,
                                                               const int32_t* claim) {
  __shared__ bool failed;
  if (threadIdx.x == 0) failed = device_failed(claim);
  __syncthreads();
  poison_bytes(dq, bytes, failed ? 0xFF : 0x00, uint64_t(blockIdx.x) * blockDim.x + threadIdx.x,
               uint64_t(gridDim.x) * blockDim.x);
}

cudaError_t init_dq(const Params& p) {
  const uint64_t bytes = uint64_t(p.batch) * uint64_t(p.s_q) * uint64_t(p.q_heads) *
                         uint64_t(p.head_dim) * sizeof(float);
  const uint64_t per_block = uint64_t(kFillThreads) * 16 * 8;  // 8 vectors per thread
  const int blocks = int(std::clamp<uint64_t>((bytes + per_block - 1) / per_block, 1, 2048));
  init_dq_kernel<<<blocks, kFillThreads, 0, p.stream>>>(p.dq, bytes, p.claim);
  return cudaGetLastError();
}

using Instantiations =
    variants::Built<Variant<DType::kBF16, 128>, Variant<DType::kBF16, 64>,
                    Variant<DType::kF16, 128>, Variant<DType::kF16, 64>>;

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

cudaError_t check(const Params& p) {
  if (!supported(p)) return cudaErrorNotSupported;
  return Instantiations::check(VariantKey{p.dtype, p.head_dim}, p);
}

cudaError_t run(const Params& p) {
  if (!supported(p)) return cudaErrorNotSupported;
  const VariantKey key{p.dtype, p.head_dim};
  PK_CUDA_TRY(Instantiations::check(key, p));  // refuse before the first enqueue
  if (!p.accumulate_dq) PK_CUDA_TRY(init_dq(p));
  return Instantiations::launch(key, p);
}

cudaError_t load_kernels() {
  cudaFuncAttributes attr;
  PK_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(init_dq_kernel)));
  return Instantiations::load();
}

}  // namespace pk::attention_bwd
