// What the attention kernel families (ring forward, block backward) share on
// the host: launching a CUTLASS device kernel with more than the default
// 48 KiB of dynamic shared memory, and the four (element type, head dim)
// variants each family is instantiated for, one per file.
#pragma once

#include <cuda_runtime.h>

#include "pk/cuda_check.h"

#ifdef PK_HAVE_CUTLASS
#include <cutlass/device_kernel.h>
#include <cutlass/numeric_types.h>

namespace pk::attention_variants {

using BF16 = cutlass::bfloat16_t;
using F16 = cutlass::half_t;

// Raise the kernel's shared-memory limit. Called once at start-up too, where
// the first query of the function loads its module (no lazy load mid-call).
template <class Kernel>
cudaError_t load_kernel() {
  cudaFuncAttributes attr;
  PK_CUDA_TRY(cudaFuncGetAttributes(&attr, cutlass::device_kernel<Kernel>));
  return cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(Kernel::SharedStorageSize));
}

// One launch with the kernel's own grid and block shapes.
template <class Kernel>
cudaError_t launch_kernel(typename Kernel::Params const& params, cudaStream_t stream) {
  PK_CUDA_TRY(cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   int(Kernel::SharedStorageSize)));
  cutlass::device_kernel<Kernel><<<Kernel::get_grid_shape(params), Kernel::get_block_shape(),
                                   Kernel::SharedStorageSize, stream>>>(params);
  return cudaGetLastError();
}

// A family's variants: a struct with static member templates
//   template <class Element, int kHeadDim> static cudaError_t launch(const Args&);
//   template <class Element, int kHeadDim> static cudaError_t load();
// specialized in one file per variant.

// The variant for the runtime pair (bf16 or fp16, head dim 64 or 128);
// cudaErrorNotSupported for any other head dim.
template <class Family, class Args>
cudaError_t launch(bool bf16, int head_dim, const Args& args) {
  if (head_dim == 128)
    return bf16 ? Family::template launch<BF16, 128>(args) : Family::template launch<F16, 128>(args);
  if (head_dim == 64)
    return bf16 ? Family::template launch<BF16, 64>(args) : Family::template launch<F16, 64>(args);
  return cudaErrorNotSupported;
}

// Every variant's load(), stopping at the first error.
template <class Family>
cudaError_t load_all() {
  PK_CUDA_TRY((Family::template load<BF16, 128>()));
  PK_CUDA_TRY((Family::template load<BF16, 64>()));
  PK_CUDA_TRY((Family::template load<F16, 128>()));
  return Family::template load<F16, 64>();
}

}  // namespace pk::attention_variants
#endif  // PK_HAVE_CUTLASS

// Specializes FAMILY's launch/load for one variant with KERNEL<ELEMENT,
// HEAD_DIM> (a struct with `static cudaError_t launch(ARGS)` and a `Kernel`
// type); one use per file keeps each compile unit's time in bounds.
#define PK_ATTENTION_VARIANT(NS, FAMILY, KERNEL, ARGS, ELEMENT, HEAD_DIM)                        \
  namespace NS {                                                                                \
  template <>                                                                                   \
  cudaError_t FAMILY::launch<ELEMENT, HEAD_DIM>(ARGS args) {                                    \
    return KERNEL<ELEMENT, HEAD_DIM>::launch(args);                                             \
  }                                                                                             \
  template <>                                                                                   \
  cudaError_t FAMILY::load<ELEMENT, HEAD_DIM>() {                                               \
    return ::pk::attention_variants::load_kernel<typename KERNEL<ELEMENT, HEAD_DIM>::Kernel>(); \
  }                                                                                             \
  }
