// The GEMM's cuBLASLt backend: the same Problem (gemm.h) run by NVIDIA's
// library instead of the CUTLASS kernel, chosen process-wide by
// gemm::set_backend.
//
// libcublasLt is opened at run time (dlopen), never linked, so the extension
// loads where the library is missing; it is compiled in only where the build
// found cublasLt.h (PK_HAVE_CUBLASLT). One handle per device; one plan
// (descriptors and the heuristic's first algorithm) per problem key, made on
// first use and kept for the process, so a call costs one cublasLtMatmul.
// cuBLASLt's kernels load lazily at their first launch (no preload as for
// ours): the first GEMM of each shape outside a peer wait loads it.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "kernels/gemm/gemm.h"

namespace pk::gemm::cublaslt {

// Opens libcublasLt: the soname of the version built against (the copy XLA
// loaded, if any), else each path of `candidates` in order. "" once loaded (also on later calls), else why
// not (no header at build time, no library, a different major version).
std::string load(const std::vector<std::string>& candidates);

// load() succeeded.
bool loaded();

// The library's version (cublasLtGetVersion, e.g. 131000), 0 when not loaded.
size_t version();

// cudaSuccess when cuBLASLt has an algorithm for `p` on `dev` (the plan is
// made and cached here); cudaErrorNotSupported when not loaded or not
// supported(p), cudaErrorInvalidValue when the heuristic finds nothing.
cudaError_t check(const Problem& p, const Device& dev);

// check(), then one cublasLtMatmul on `stream` with dev's workspace.
cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream);

}  // namespace pk::gemm::cublaslt
