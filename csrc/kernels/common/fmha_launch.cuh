// Launching the attention families' CUTLASS device kernels (ring forward,
// block backward): both need more than the default 48 KiB of dynamic shared
// memory.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/device_kernel.h>

#include "pk/cuda_check.h"

namespace pk::fmha_launch {

// Raise the kernel's shared-memory limit. Called at init, where the first
// query of the function loads its module (no lazy load mid-call).
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

}  // namespace pk::fmha_launch
