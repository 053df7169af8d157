// The ld/st pushes of the all_reduce family: up to kMaxRanks strided copies
// in one launch, SM loads of local memory and stores that may cross NVLink
// into a peer's workspace (or stay local: the all-gather phase's drain).
#include <algorithm>
#include <array>

#include "kernels/all_reduce/all_reduce.h"
#include "pk/copy.cuh"
#include "pk/cuda_check.h"

namespace pk::all_reduce {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // vectors per thread and step: loads in flight

// ---- arguments -------------------------------------------------------------
// CopyJobs (all_reduce.h), by value; V the widest vector every address,
// pitch and row size of the launch allows.

// ---- roles -----------------------------------------------------------------
// Job k's vectors are numbered row-major; every block walks every job's
// vectors with the grid stride, jobs one after another (a launch is short:
// no job-to-block balancing needed beyond the flat numbering).
template <typename V>
__device__ __forceinline__ void copy_job(const CopyJob& j, uint64_t first, uint64_t step) {
  const uint64_t row_vecs = j.row_bytes / sizeof(V);
  const uint64_t total = j.rows * row_vecs;
  const uint64_t src_pitch = j.src_pitch / sizeof(V), dst_pitch = j.dst_pitch / sizeof(V);
  const V* src = static_cast<const V*>(j.src);
  V* dst = static_cast<V*>(j.dst);
  for (uint64_t base = first; base < total; base += step) {
    V v[kUnroll];
    uint64_t r[kUnroll], c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t k = base + uint64_t(u) * blockDim.x;
      r[u] = j.rows == 1 ? 0 : k / row_vecs;
      c[u] = k - r[u] * row_vecs;
      if (k < total) v[u] = __ldcg(src + r[u] * src_pitch + c[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + uint64_t(u) * blockDim.x < total) dst[r[u] * dst_pitch + c[u]] = v[u];
  }
}

// ---- entry point -----------------------------------------------------------
template <typename V>
__global__ void __launch_bounds__(kThreads) copy_jobs_kernel(const __grid_constant__ CopyJobs a) {
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x * kUnroll;
  for (int k = 0; k < a.count; ++k) copy_job<V>(a.job[k], first, step);
}

template <typename V>
cudaError_t launch_typed(const CopyJobs& a, uint64_t bytes, int sm_count, cudaStream_t s) {
  const uint64_t per_block = uint64_t(kThreads) * kUnroll * sizeof(V);
  const int blocks = int(std::clamp<uint64_t>((bytes / std::max(a.count, 1) + per_block - 1) /
                                                  per_block,
                                              1, uint64_t(std::max(sm_count, 1))));
  copy_jobs_kernel<V><<<blocks, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_copy_jobs(const CopyJobs& jobs, int sm_count, cudaStream_t s) {
  uint64_t bits = 0, bytes = 0;  // OR of every address, pitch and size: the alignment
  CopyJobs a{};
  for (int k = 0; k < jobs.count; ++k) {
    const CopyJob& j = jobs.job[k];
    if (j.rows == 0 || j.row_bytes == 0) continue;
    a.job[a.count++] = j;
    bits |= reinterpret_cast<uintptr_t>(j.src) | reinterpret_cast<uintptr_t>(j.dst) |
            j.row_bytes | (j.rows > 1 ? j.src_pitch | j.dst_pitch : 0);
    bytes += j.rows * j.row_bytes;
  }
  if (a.count == 0) return cudaSuccess;
  return with_access_width(access_width(bits), [&](auto tag) {
    return launch_typed<typename decltype(tag)::type>(a, bytes, sm_count, s);
  });
}

cudaError_t load_copy_kernels() {
  return preload_per_width([](auto tag) {
    using V = typename decltype(tag)::type;
    return std::array{reinterpret_cast<const void*>(copy_jobs_kernel<V>)};
  });
}

}  // namespace pk::all_reduce
