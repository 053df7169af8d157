// Tensor-parallel matmuls with their communication overlapped: host-side
// sequences of GEMMs (kernels/gemm), copy-engine transfers and signals.
//
// all_gather_matmul: out[n*m, N] = concat_q(x_q)[n*m, K] @ w[K, N]
//   side stream: the copy engines push x into slot r of every peer's region,
//                posting each peer as its copy lands;
//   main stream: GEMM of our own rows, then of each peer's rows as they land.
// matmul_reduce_scatter: out[m, N] = sum_q (x_q[rows of r] @ w_q)
//   one stream: the GEMM of peer q's rows stores its tile outputs straight
//   into slot r of q's region over NVLink; then our own rows: with two ranks
//   their GEMM adds the peer's slot in its epilogue and writes our shard;
//   with more, it fills our slot and a sum of the n slots in fp32 follows.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemm/gemm.h"
#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::tp_matmul {

struct Params {
  const void* x = nullptr;
  const void* w = nullptr;   // [K, N] row-major, or [N, K] if w_transposed
  bool w_transposed = false; // the backward passes' w^T, without a copy
  void* out = nullptr;
  void* gathered = nullptr;  // all_gather_matmul: the gathered x, or null
  int64_t m = 0;             // rows per rank (x's for all_gather_matmul, out's for RS)
  int64_t k = 0;
  int64_t n_cols = 0;        // N
  gemm::DType in = gemm::DType::kBF16;
  gemm::DType out_type = gemm::DType::kBF16;
  int rank = 0;
  int n = 1;
  Channel ch{};
  char* region[kMaxRanks] = {};  // this channel's data region on every rank
  size_t region_bytes = 0;
  bool skip_post = false;
  gemm::Device gemm_dev{};
  cudaStream_t stream = nullptr;
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

// Bytes of the channel's data region each op needs: n slots of one rank's block
// (matmul_reduce_scatter with n = 2 leaves our own slot unused).
inline size_t ag_matmul_region_bytes(int n, int64_t m, int64_t k, gemm::DType in) {
  return size_t(n) * m * k * gemm::itemsize(in);
}
inline size_t matmul_rs_region_bytes(int n, int64_t m, int64_t n_cols, gemm::DType out) {
  return size_t(n) * m * n_cols * gemm::itemsize(out);
}

cudaError_t all_gather_matmul(const Params& p);
cudaError_t matmul_reduce_scatter(const Params& p);

// Load the helper kernels on the current device.
cudaError_t load_kernels();

}  // namespace pk::tp_matmul
