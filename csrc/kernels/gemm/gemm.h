// Dense GEMM on Hopper, row-major: D[m, n] = A[m, k] @ B[k, n] (+ C[m, n]),
// fp32 accumulation.
//
// The building block of the tensor-parallel ops: they run it on row chunks as
// the rows arrive (all_gather_matmul) or point D at a peer's memory so the
// epilogue's stores travel over NVLink, and add the peer's partial sums as C
// (matmul_reduce_scatter). The backward passes multiply by w^T: B may be
// given transposed, so no transposed copy of a weight is ever made; A may be
// given transposed for the weight gradients (dW = X^T @ dY reads X [k, m]
// row-major in place: the contraction runs over the rows of both operands).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"

namespace pk::gemm {

using pk::DType;
using pk::itemsize;

struct Problem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k] row-major, or [k, m] row-major if a_transposed
  const void* b = nullptr;  // [k, n] row-major, or [n, k] row-major if b_transposed
  const void* c = nullptr;  // null, or [m, n] row-major of the output type: D = A @ B + C
  void* d = nullptr;        // [m, n] row-major, may live on a peer GPU
  bool b_transposed = false;
  bool a_transposed = false;  // only with B row-major and the output in the input type
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

// Inputs bf16 or f16; output the input type or f32 (the input type only when
// b_transposed or a_transposed; not both transposed); n and the row length of
// A (k, or m when a_transposed) multiples of 8 (16-byte rows for the TMA
// copies).
bool supported(const Problem& p);

// Load every instantiation on the current device (no lazy loading later).
cudaError_t load_kernels();

// Returns cudaErrorNotSupported for unsupported problems, cudaErrorInvalidValue
// when CUTLASS rejects the arguments or needs more scratch.
cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream);

// What run() would return for `p` short of launching: cudaSuccess when it
// would launch. Host sequences check every GEMM of a call before they
// enqueue anything.
cudaError_t check(const Problem& p, const Device& dev);

// The instantiations (kernels/common/variants.h): one per (input type, output
// type, B layout, A layout), instantiations/gemm_<in>_<out>[_bt|_at].cu;
// defined in gemm_sm90.cuh.
struct VariantKey {
  DType in, out;
  bool b_transposed;
  bool a_transposed = false;
};
constexpr bool operator==(const VariantKey& a, const VariantKey& b) {
  return a.in == b.in && a.out == b.out && a.b_transposed == b.b_transposed &&
         a.a_transposed == b.a_transposed;
}
template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed = false>
struct Variant {
  static constexpr VariantKey key{kIn, kOut, kBTransposed, kATransposed};
  static cudaError_t check(const Problem& p, const Device& dev);
  static cudaError_t launch(const Problem& p, const Device& dev, cudaStream_t stream);
  static cudaError_t load();
};

}  // namespace pk::gemm
