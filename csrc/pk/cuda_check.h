// Propagate a failing CUDA runtime call to the caller as its cudaError_t.
#pragma once

#include <cuda_runtime.h>

#define PK_CUDA_TRY(expr)                                              \
  do {                                                                 \
    if (cudaError_t pk_err_ = (expr); pk_err_ != cudaSuccess) return pk_err_; \
  } while (0)
