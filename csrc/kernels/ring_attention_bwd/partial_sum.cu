// The partial dK/dV adds of the fused ring backward (ring_attention_bwd.h):
// out = a + b (fp32: the partial that came from the previous rank plus our
// contribution, before it goes on to the next rank), and out = cast(a + b) (the last step: the finished sum in the input
// type, before it goes home). One fp32 add per element, so the ring's order
// of additions is the order of the calls. While the device holds an error
// the result is NaN instead (one load of the claim word per CTA).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/ring_attention_bwd/ring_attention_bwd.h"
#include "pk/cuda_check.h"
#include "pk/sync.cuh"

namespace pk::ring_attention_bwd {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // grid-stride beyond: a memory-bound pass

// ---- arguments -------------------------------------------------------------
// a, b: fp32 [count]; out: [count] of T. poison: `words` 16-byte words.

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }

// ---- entry point -----------------------------------------------------------
// out[i] = a[i] + b[i] (as T), or NaN when the device failed. 16-byte loads
// where count allows: the fp32 buffers are 256-byte aligned (region slots,
// XLA buffers) and count is a multiple of 4 (head dim 64 or 128).
template <typename T>
__global__ void __launch_bounds__(kThreads) add_kernel(T* out, const float* a, const float* b,
                                                       size_t count, const int32_t* claim) {
  __shared__ bool failed;
  if (threadIdx.x == 0) failed = device_failed(claim);
  __syncthreads();
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const float nan = __int_as_float(0x7fffffff);
  for (size_t v = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v < count / 4; v += stride) {
    const float4 x = reinterpret_cast<const float4*>(a)[v];
    const float4 y = reinterpret_cast<const float4*>(b)[v];
    T* o = out + 4 * v;
    store(o + 0, failed ? nan : x.x + y.x);
    store(o + 1, failed ? nan : x.y + y.y);
    store(o + 2, failed ? nan : x.z + y.z);
    store(o + 3, failed ? nan : x.w + y.w);
  }
}

// NaN (all bits set) over p[0 .. words) when the device failed; otherwise
// one load of the claim word and nothing else.
__global__ void __launch_bounds__(kThreads) poison_kernel(uint4* p, size_t words,
                                                          const int32_t* claim) {
  __shared__ bool failed;
  if (threadIdx.x == 0) failed = device_failed(claim);
  __syncthreads();
  if (!failed) return;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t v = size_t(blockIdx.x) * blockDim.x + threadIdx.x; v < words; v += stride)
    p[v] = make_uint4(~0u, ~0u, ~0u, ~0u);
}

int blocks_for(size_t vecs) {
  return int(std::clamp<size_t>((vecs + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

template <typename T>
cudaError_t launch(T* out, const float* a, const float* b, size_t count, const int32_t* claim,
                   cudaStream_t stream) {
  if (count % 4 != 0) return cudaErrorInvalidValue;
  add_kernel<T><<<blocks_for(count / 4), kThreads, 0, stream>>>(out, a, b, count, claim);
  return cudaGetLastError();
}

}  // namespace

cudaError_t add_partial(float* out, const float* a, const float* b, size_t count,
                        const int32_t* claim, cudaStream_t stream) {
  return launch<float>(out, a, b, count, claim, stream);
}

cudaError_t add_cast(void* out, DType type, const float* a, const float* b, size_t count,
                     const int32_t* claim, cudaStream_t stream) {
  switch (type) {
    case DType::kBF16:
      return launch(static_cast<__nv_bfloat16*>(out), a, b, count, claim, stream);
    case DType::kF16: return launch(static_cast<__half*>(out), a, b, count, claim, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t poison_if_failed(void* p, size_t bytes, const int32_t* claim, cudaStream_t stream) {
  if (bytes % sizeof(uint4) != 0) return cudaErrorInvalidValue;
  const size_t words = bytes / sizeof(uint4);
  // One CTA: it runs on the side stream beside the block kernel, so it
  // should need little to get an SM; poisoning is the (slow) failure path.
  poison_kernel<<<1, kThreads, 0, stream>>>(static_cast<uint4*>(p), words, claim);
  return cudaGetLastError();
}

cudaError_t load_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(poison_kernel),reinterpret_cast<const void*>(add_kernel<float>),
                           reinterpret_cast<const void*>(add_kernel<__nv_bfloat16>),
                           reinterpret_cast<const void*>(add_kernel<__half>)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    PK_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
  }
  return cudaSuccess;
}

}  // namespace pk::ring_attention_bwd
