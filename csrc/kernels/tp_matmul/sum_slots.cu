// out = sum over q < n of slot q (each m x N of the output type), accumulated
// in fp32 in rank order: the reduction step of matmul_reduce_scatter and
// matmul_all_reduce. With `wait`, every block first waits (bounded) until
// every peer posted this call on the channel: the wait and the sum in one
// launch, for the latency-bound one-shot path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/post_layout.cuh"
#include "pk/sync.cuh"

namespace pk::tp_matmul {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per thread and step (16 bytes of 16-bit types)

// ---- arguments -------------------------------------------------------------
template <typename T>
struct SumArgs {
  const T* slots;  // n slots of `count` elements, back to back
  T* out;
  int64_t count;
  int n;
  bool wait;  // wait for every peer's post on `ch` first, and check its layout
  Channel ch;
  signals::PostLayout layout;
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }

// ---- entry point -----------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) sum_slots_kernel(const __grid_constant__ SumArgs<T> a) {
  if (a.wait) {  // thread q waits for rank q; the barrier orders the block's reads after
    const int q = threadIdx.x;
    if (q < a.ch.n && q != a.ch.rank) signals::wait_posted_layout(a.ch, q, a.layout);
    __syncthreads();
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < a.count;
       i += stride) {
    float acc[kVec] = {};
    const int len = a.count - i < kVec ? int(a.count - i) : kVec;
    for (int q = 0; q < a.n; ++q) {
      const T* src = a.slots + q * a.count + i;
#pragma unroll
      for (int v = 0; v < kVec; ++v)
        if (v < len) acc[v] += to_f32(src[v]);
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v)
      if (v < len) a.out[i + v] = from_f32<T>(acc[v]);
  }
}

template <typename T>
cudaError_t launch_typed(const Params& p, const char* slots, cudaStream_t s, bool wait) {
  SumArgs<T> a{reinterpret_cast<const T*>(slots), static_cast<T*>(p.out), p.m * p.n_cols, p.n,
               wait, p.ch, out_rows_layout(p)};
  const int64_t per_block = int64_t(kThreads) * kVec;
  const int blocks = int(std::clamp<int64_t>((a.count + per_block - 1) / per_block, 1,
                                             int64_t(p.gemm_dev.sm_count) * 8));
  sum_slots_kernel<T><<<blocks, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sum_slots(const Params& p, const char* slots, cudaStream_t s,
                             bool wait_posted) {
  switch (p.out_type) {
    case gemm::DType::kBF16: return launch_typed<__nv_bfloat16>(p, slots, s, wait_posted);
    case gemm::DType::kF16: return launch_typed<__half>(p, slots, s, wait_posted);
    default: return launch_typed<float>(p, slots, s, wait_posted);
  }
}

cudaError_t load_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(sum_slots_kernel<__nv_bfloat16>),
                           reinterpret_cast<const void*>(sum_slots_kernel<__half>),
                           reinterpret_cast<const void*>(sum_slots_kernel<float>)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    PK_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
  }
  return cudaSuccess;
}

}  // namespace pk::tp_matmul
