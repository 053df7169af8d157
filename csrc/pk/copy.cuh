// Vectorized row copies used by communication kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pk/cuda_check.h"
#include "pk/type_tag.h"

namespace pk {

// Widest access, in bytes (16, 8, 4, 2 or 1), that divides `bits`: the OR
// of every address, size and offset a kernel forms.
inline int access_width(uint64_t bits) {
  for (int w = 16; w > 1; w /= 2)
    if (bits % w == 0) return w;
  return 1;
}

// f(TypeTag<V>{}) with V the type of `width` bytes (uint4, uint2, unsigned
// int, unsigned short, unsigned char): a kernel's launch, instantiated per
// width.
template <typename F>
cudaError_t with_access_width(int width, F&& f) {
  switch (width) {
    case 16: return f(TypeTag<uint4>{});
    case 8:  return f(TypeTag<uint2>{});
    case 4:  return f(TypeTag<unsigned int>{});
    case 2:  return f(TypeTag<unsigned short>{});
    default: return f(TypeTag<unsigned char>{});
  }
}

// preload_kernel for every address `kernels(TypeTag<V>{})` lists (an array of
// kernel addresses), for every access width's V; the first error.
template <typename F>
cudaError_t preload_per_width(F&& kernels) {
  for (int width : {16, 8, 4, 2, 1}) {
    PK_CUDA_TRY(with_access_width(width, [&](auto tag) {
      for (const void* k : kernels(tag)) PK_CUDA_TRY(preload_kernel(k));
      return cudaSuccess;
    }));
  }
  return cudaSuccess;
}

// Bytes moved by one thread per step, per access width: enough loads in
// flight per thread to cover NVLink latency (about 1-2 us) at full rate.
inline constexpr int kCopyUnroll = 4;

// One rank's block in the all_gather layout: `rows` rows of `row_vecs`
// vectors, contiguous at the source, row stride `dst_stride` at the destination.
template <typename V>
struct RowBlock {
  const V* src;
  V* dst;
  uint64_t rows;
  uint64_t row_vecs;
  uint64_t dst_stride;

  __device__ __forceinline__ uint64_t size() const { return rows * row_vecs; }
  __device__ __forceinline__ uint64_t dst_index(uint64_t k) const {
    if (rows == 1) return k;
    const uint64_t r = k / row_vecs;
    return r * dst_stride + (k - r * row_vecs);
  }
};

// Vectors one block copies per chunk: every thread keeps kCopyUnroll loads
// in flight. Loads bypass L1 (`.cg`): the source may be a peer's memory.
template <typename V>
__device__ __forceinline__ void copy_chunk(const RowBlock<V>& b, uint64_t first) {
  const uint64_t end = b.size();
  V v[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const uint64_t k = first + threadIdx.x + uint64_t(u) * blockDim.x;
    if (k < end) v[u] = __ldcg(b.src + k);
  }
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const uint64_t k = first + threadIdx.x + uint64_t(u) * blockDim.x;
    if (k < end) b.dst[b.dst_index(k)] = v[u];
  }
}

}  // namespace pk
