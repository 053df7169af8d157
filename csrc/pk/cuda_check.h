// Propagate a failing CUDA runtime call to the caller as its cudaError_t.
#pragma once

#include <cuda_runtime.h>

#define PK_CUDA_TRY(expr)                                              \
  do {                                                                 \
    if (cudaError_t pk_err_ = (expr); pk_err_ != cudaSuccess) return pk_err_; \
  } while (0)

namespace pk {

// Loads a kernel's module now (cudaFuncGetAttributes), so that no first call
// inside a CUDA graph capture loads it lazily.
inline cudaError_t preload_kernel(const void* kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace pk
