// The rank-ordered sum every all_reduce kernel computes (all_reduce.h:
// summation order): sources 0..n-1 added in that order, fp32 accumulation
// for 16-bit floats with one rounding, the type itself for fp32 and int32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/all_reduce/all_reduce.h"
#include "pk/cuda_check.h"
#include "pk/type_tag.h"

namespace pk::all_reduce {

// f(TypeTag<T>{}) with T the C++ type of `t` (a kernel's launch,
// instantiated per element type); cudaErrorInvalidValue for an unknown `t`.
template <typename F>
cudaError_t with_elem_type(Elem t, F&& f) {
  switch (t) {
    case Elem::kBF16: return f(TypeTag<__nv_bfloat16>{});
    case Elem::kF16: return f(TypeTag<__half>{});
    case Elem::kF32: return f(TypeTag<float>{});
    case Elem::kS32: return f(TypeTag<int32_t>{});
  }
  return cudaErrorInvalidValue;
}

// Loads the packed and unpacked instantiations of a sum kernel for every
// element type (`kernel(tag, packed)`: its address), so that no first call
// loads a module lazily; the first error.
template <typename F>
cudaError_t preload_sum_kernels(F&& kernel) {
  for (Elem t : {Elem::kBF16, Elem::kF16, Elem::kF32, Elem::kS32}) {
    PK_CUDA_TRY(with_elem_type(t, [&](auto tag) {
      PK_CUDA_TRY(preload_kernel(kernel(tag, std::true_type{})));
      return preload_kernel(kernel(tag, std::false_type{}));
    }));
  }
  return cudaSuccess;
}

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

inline constexpr int kSumUnroll = 4;  // elements per thread and step: loads in flight

// The elements [first, ...) of a's rows x len, every `step`-th group of
// kSumUnroll * blockDim.x (the caller's grid-stride partition).
template <typename T>
__device__ inline void sum_range(const ReduceArgs& a, uint64_t first, uint64_t step) {
  using A = typename Acc<T>::type;
  const uint64_t total = a.rows * a.len;
  for (uint64_t base = first; base < total; base += step) {
    uint64_t at[kSumUnroll], row[kSumUnroll], col[kSumUnroll];  // flat index, row, column
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      at[u] = base + threadIdx.x + uint64_t(u) * blockDim.x;
      row[u] = a.rows == 1 ? 0 : at[u] / a.len;
      col[u] = at[u] - row[u] * a.len;
    }
    A acc[kSumUnroll];
    for (int q = 0; q < a.n; ++q) {
      const T* src = static_cast<const T*>(a.src[q]);
      T v[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (at[u] < total) v[u] = __ldcg(src + row[u] * a.src_stride[q] + col[u]);
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if (at[u] < total) acc[u] = q == 0 ? widen(v[u]) : add(acc[u], widen(v[u]));
    }
    T* dst = static_cast<T*>(a.dst);
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (at[u] < total) dst[row[u] * a.dst_stride + col[u]] = narrow<T>(acc[u]);
  }
}

// The same sum in 16-byte packs of 16 / sizeof(T) elements: one vector load
// per source and pack, the identical per-element order (the same bits).
// Requires packable(a).
inline constexpr int kPackUnroll = 2;
template <typename T>
__device__ inline void sum_range_packed(const ReduceArgs& a, uint64_t first, uint64_t step) {
  using A = typename Acc<T>::type;
  constexpr int P = 16 / sizeof(T);
  const uint64_t len = a.len / P;
  const uint64_t total = a.rows * len;
  for (uint64_t base = first; base < total; base += step) {
    uint64_t at[kPackUnroll], row[kPackUnroll], col[kPackUnroll];
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u) {
      at[u] = base + threadIdx.x + uint64_t(u) * blockDim.x;
      row[u] = a.rows == 1 ? 0 : at[u] / len;
      col[u] = at[u] - row[u] * len;
    }
    A acc[kPackUnroll][P];
    for (int q = 0; q < a.n; ++q) {
      const uint4* src = static_cast<const uint4*>(a.src[q]);
      const uint64_t stride = a.src_stride[q] / P;
      uint4 raw[kPackUnroll];
#pragma unroll
      for (int u = 0; u < kPackUnroll; ++u)
        if (at[u] < total) raw[u] = __ldcg(src + row[u] * stride + col[u]);
#pragma unroll
      for (int u = 0; u < kPackUnroll; ++u) {
        const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int j = 0; j < P; ++j) acc[u][j] = q == 0 ? widen(v[j]) : add(acc[u][j], widen(v[j]));
      }
    }
    uint4* dst = static_cast<uint4*>(a.dst);
#pragma unroll
    for (int u = 0; u < kPackUnroll; ++u) {
      if (at[u] >= total) continue;
      uint4 out;
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int j = 0; j < P; ++j) o[j] = narrow<T>(acc[u][j]);
      dst[row[u] * (a.dst_stride / P) + col[u]] = out;
    }
  }
}

// Whether sum_range_packed can take `a`: every address 16-byte aligned, and
// the row length and every row stride whole packs.
inline bool packable(const ReduceArgs& a, size_t esize) {
  const uint64_t p = 16 / esize;
  bool ok = a.len % p == 0 && reinterpret_cast<uintptr_t>(a.dst) % 16 == 0 &&
            (a.rows == 1 || a.dst_stride % p == 0);
  for (int q = 0; q < a.n; ++q)
    ok = ok && reinterpret_cast<uintptr_t>(a.src[q]) % 16 == 0 &&
         (a.rows == 1 || a.src_stride[q] % p == 0);
  return ok;
}

// The grid's share: thread (block, x) of a grid of `blocks` x blockDim.x.
template <typename T, bool kPacked>
__device__ __forceinline__ void sum_grid(const ReduceArgs& a) {
  if constexpr (kPacked)
    sum_range_packed<T>(a, uint64_t(blockIdx.x) * blockDim.x * kPackUnroll,
                        uint64_t(gridDim.x) * blockDim.x * kPackUnroll);
  else
    sum_range<T>(a, uint64_t(blockIdx.x) * blockDim.x * kSumUnroll,
                 uint64_t(gridDim.x) * blockDim.x * kSumUnroll);
}

}  // namespace pk::all_reduce
