// The reduction of every all_reduce / reduce_scatter mechanism: out = the sum
// of n sources in rank order 0..n-1, fp32 accumulation for 16-bit floats,
// rounded once (all_reduce.h: summation order). A generalisation of the slot
// sum of matmul_reduce_scatter (strided sources, int32).
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
// sum_range (sum.cuh): the grid-stride partition of the rows x len elements.

// ---- entry point -----------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const __grid_constant__ ReduceArgs a) {
  sum_range<T>(a, uint64_t(blockIdx.x) * blockDim.x * kSumUnroll,
               uint64_t(gridDim.x) * blockDim.x * kSumUnroll);
}

template <typename T>
cudaError_t launch_typed(const ReduceArgs& a, int sm_count, cudaStream_t s) {
  const uint64_t total = a.rows * a.len;
  if (total == 0) return cudaSuccess;
  const uint64_t per_block = uint64_t(kThreads) * kSumUnroll;
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
