// The reduction of every all_reduce / reduce_scatter mechanism: out = the sum
// of n sources in rank order 0..n-1, fp32 accumulation for 16-bit floats,
// rounded once (all_reduce.h: summation order). A generalisation of the slot
// sum of matmul_reduce_scatter (strided sources, int32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/all_reduce/all_reduce.h"
#include "pk/cuda_check.h"

namespace pk::all_reduce {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;
constexpr int kUnroll = 4;  // elements per thread and step: loads in flight

// ---- arguments -------------------------------------------------------------
// ReduceArgs (all_reduce.h), by value.

// ---- roles: accumulation type and conversions -------------------------------
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <> struct Acc<__half> { using type = float; };

__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ int32_t widen(int32_t v) { return v; }

template <typename T> __device__ __forceinline__ T narrow(typename Acc<T>::type v);
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ int32_t narrow<int32_t>(int32_t v) { return v; }

// Plain adds, never contracted into anything else: the order is the contract.
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ int32_t add(int32_t a, int32_t b) {
  return int32_t(uint32_t(a) + uint32_t(b));  // wraps, as XLA's int32 add
}

// ---- entry point -----------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const __grid_constant__ ReduceArgs a) {
  using A = typename Acc<T>::type;
  const uint64_t total = a.rows * a.len;
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x * kUnroll;
  for (uint64_t base = uint64_t(blockIdx.x) * blockDim.x * kUnroll; base < total; base += step) {
    uint64_t at[kUnroll], row[kUnroll], col[kUnroll];  // flat index, row, column
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      at[u] = base + threadIdx.x + uint64_t(u) * blockDim.x;
      row[u] = a.rows == 1 ? 0 : at[u] / a.len;
      col[u] = at[u] - row[u] * a.len;
    }
    A acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc[u] = A(0);
    for (int q = 0; q < a.n; ++q) {
      const T* src = static_cast<const T*>(a.src[q]);
      T v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (at[u] < total) v[u] = __ldcg(src + row[u] * a.src_stride[q] + col[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (at[u] < total) acc[u] = q == 0 ? widen(v[u]) : add(acc[u], widen(v[u]));
    }
    T* dst = static_cast<T*>(a.dst);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (at[u] < total) dst[row[u] * a.dst_stride + col[u]] = narrow<T>(acc[u]);
  }
}

template <typename T>
cudaError_t launch_typed(const ReduceArgs& a, int sm_count, cudaStream_t s) {
  const uint64_t total = a.rows * a.len;
  if (total == 0) return cudaSuccess;
  const uint64_t per_block = uint64_t(kThreads) * kUnroll;
  const int blocks = int(std::clamp<uint64_t>((total + per_block - 1) / per_block, 1,
                                              uint64_t(std::max(sm_count, 1)) * kBlocksPerSm));
  reduce_kernel<T><<<blocks, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reduce(const ReduceArgs& a, Elem t, int sm_count, cudaStream_t s) {
  switch (t) {
    case Elem::kBF16: return launch_typed<__nv_bfloat16>(a, sm_count, s);
    case Elem::kF16: return launch_typed<__half>(a, sm_count, s);
    case Elem::kF32: return launch_typed<float>(a, sm_count, s);
    case Elem::kS32: return launch_typed<int32_t>(a, sm_count, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t load_reduce_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(reduce_kernel<__nv_bfloat16>),
                           reinterpret_cast<const void*>(reduce_kernel<__half>),
                           reinterpret_cast<const void*>(reduce_kernel<float>),
                           reinterpret_cast<const void*>(reduce_kernel<int32_t>)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    PK_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
  }
  return cudaSuccess;
}

}  // namespace pk::all_reduce
