// The FP8 GEMMs through NVIDIA's cuBLASLt (gemm.h: Library::kCublasLt).
//
// cuBLASLt is loaded at run time (dlopen: the copy XLA's GPU plugin already
// loaded, else libcublasLt.so.13 or .12 from the library path), so the
// extension builds, imports and runs without it: `loaded()` is false and the
// GEMMs run pk's CUTLASS kernels. Built only where cublasLt.h was found
// (CMakeLists.txt: PK_HAVE_CUBLASLT).
//
// The row-major problem D[m, n] = A[m, k] @ B[n, k]^T maps onto cuBLASLt's
// column-major "TN" GEMM D^T[n, m] = B[n, k] @ A[m, k]^T: cuBLASLt's A is
// gemm's B (transposed), its B gemm's A, both K-major as FP8 requires on
// Hopper. The factors are its A and B scale pointers (block factors: its
// 128x128 or 1x128 scale modes, cuBLASLt 12.9 and later on Hopper); a
// per-tensor e4m3 x e4m3 product runs fast accumulation, a product with an
// e5m2 gradient does where Problem::fast_accum asks, block factors never (the
// CUTLASS kernels' recipe otherwise); C, when given, is added with beta = 1.
#pragma once

#include <cuda_runtime.h>

#include "kernels/gemm/gemm.h"

namespace pk::gemm::cublaslt {

// Loads the library and creates the current device's handle (once per
// device; called by load_kernels at the runtime's init, outside any graph
// capture). cudaSuccess also where the library is missing.
cudaError_t load();

// The loaded library's version (cublasLtGetVersion), 0 when it is not loaded.
int version();

// Whether a library-chosen kernel takes `p` (an FP8 problem that
// gemm::supported accepts) on `dev`: the library is loaded, this device's
// handle exists and cuBLASLt's heuristic returns a kernel for the problem's
// shapes, types and pointer alignments within dev's workspace (cached).
bool takes(const Problem& p, const Device& dev);

// Runs `p` on `stream`; cudaErrorNotSupported, with nothing enqueued, where
// takes(p, dev) is false (gemm::run then runs the CUTLASS kernel).
cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream);

}  // namespace pk::gemm::cublaslt
