// Dense GEMM on Hopper, row-major: D[m, n] = A[m, k] @ B[k, n], fp32 accumulation.
//
// The building block of the tensor-parallel ops: they run it on row chunks as
// the rows arrive (all_gather_matmul) or point D at a peer's memory so the
// epilogue's stores travel over NVLink (matmul_reduce_scatter).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pk::gemm {

enum class DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Bytes per element.
inline size_t itemsize(DType t) { return t == DType::kF32 ? 4 : 2; }

struct Problem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k] row-major
  const void* b = nullptr;  // [k, n] row-major
  void* d = nullptr;        // [m, n] row-major, may live on a peer GPU
  DType in = DType::kBF16;  // A and B
  DType out = DType::kBF16;
};

// Where the kernel runs and the scratch it may use (allocated at init).
struct Device {
  int ordinal = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// False when the extension was built without CUTLASS headers.
bool available();

// Inputs bf16 or f16; output the input type or f32; k and n multiples of 8
// (16-byte rows for the TMA copies).
bool supported(const Problem& p);

// Load every instantiation on the current device (no lazy loading later).
cudaError_t load_kernels();

// Returns cudaErrorNotSupported for unsupported problems, cudaErrorInvalidValue
// when CUTLASS rejects the arguments or needs more scratch.
cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream);

}  // namespace pk::gemm
