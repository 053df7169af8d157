// The reduction of the two-shot mechanisms: out = the sum of n sources in
// rank order 0..n-1, fp32 accumulation for 16-bit floats, rounded once
// (all_reduce.h: summation order; sum.cuh). A generalisation of the slot sum
// of matmul_reduce_scatter (strided sources, int32, 16-byte packs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/all_reduce/all_reduce.h"
#include "kernels/all_reduce/sum.cuh"
#include "pk/cuda_check.h"

namespace pk::all_reduce {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;

// ---- arguments -------------------------------------------------------------
// ReduceArgs (all_reduce.h), by value.

// ---- roles -----------------------------------------------------------------
// sum_grid (sum.cuh): the grid-stride partition of the rows x len elements,
// element by element or in 16-byte packs.

// ---- entry point -----------------------------------------------------------
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const __grid_constant__ ReduceArgs a) {
  sum_grid<T, kPacked>(a);
}

template <typename T>
cudaError_t launch_typed(const ReduceArgs& a, int sm_count, cudaStream_t s) {
  const uint64_t total = a.rows * a.len;
  if (total == 0) return cudaSuccess;
  const bool packed = packable(a, sizeof(T));
  const uint64_t per_block = uint64_t(kThreads) * (packed ? kPackUnroll * 16 / sizeof(T)
                                                          : kSumUnroll);
  const int blocks = int(std::clamp<uint64_t>((total + per_block - 1) / per_block, 1,
                                              uint64_t(std::max(sm_count, 1)) * kBlocksPerSm));
  if (packed)
    reduce_kernel<T, true><<<blocks, kThreads, 0, s>>>(a);
  else
    reduce_kernel<T, false><<<blocks, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reduce(const ReduceArgs& a, Elem t, int sm_count, cudaStream_t s) {
  return with_elem_type(t, [&](auto tag) {
    return launch_typed<typename decltype(tag)::type>(a, sm_count, s);
  });
}

cudaError_t load_reduce_kernels() {
  return preload_sum_kernels([](auto t, auto packed) {
    return reinterpret_cast<const void*>(
        reduce_kernel<typename decltype(t)::type, decltype(packed)::value>);
  });
}

}  // namespace pk::all_reduce
