// Vectorized row copies used by communication kernels.
#pragma once

#include <cstdint>

namespace pk {

// Bytes moved by one thread per step, per access width: enough loads in
// flight per thread to cover NVLink latency (about 1-2 us) at full rate.
inline constexpr int kCopyUnroll = 4;

// Copy `rows` rows of `row_vecs` vectors of type V from a contiguous source to
// a destination with row stride `dst_stride_vecs`. Work is spread over the
// whole grid (every block takes the same share). Loads bypass L1 (`.cg`): the
// source may be a peer's memory, read once.
template <typename V>
__device__ __forceinline__ void grid_copy_rows(const V* __restrict__ src,
                                               V* __restrict__ dst, uint64_t rows,
                                               uint64_t row_vecs,
                                               uint64_t dst_stride_vecs) {
  const uint64_t total = rows * row_vecs;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto dst_index = [&](uint64_t k) {
    if (rows == 1) return k;
    const uint64_t r = k / row_vecs;
    return r * dst_stride_vecs + (k - r * row_vecs);
  };
  for (; i + (kCopyUnroll - 1) * stride < total; i += kCopyUnroll * stride) {
    V v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = __ldcg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) dst[dst_index(i + u * stride)] = v[u];
  }
  for (; i < total; i += stride) dst[dst_index(i)] = __ldcg(src + i);
}

}  // namespace pk
