// Tensor-parallel matmuls with their communication overlapped: host-side
// sequences of GEMMs (kernels/gemm), copy-engine transfers and signals.
//
// all_gather_matmul: out[n*m, N] = concat_q(x_q)[n*m, K] @ w[K, N]
//   side stream: the copy engines push x into slot r of every peer's region,
//                posting each peer as its copy lands;
//   main stream: GEMM of our own rows, then of each peer's rows as they land.
// matmul_reduce_scatter: out[m, N] = sum_q (x_q[rows of r] @ w_q)
//   chunked (one stream): the GEMM of peer q's rows stores its tile outputs
//   straight into slot r of q's region over NVLink; then our own rows: with
//   two ranks their GEMM adds the peer's slot in its epilogue and writes our
//   shard; with more, it fills our slot and a sum of the n slots follows.
//   fused: one persistent GEMM over all of x; its epilogue sends each tile of
//   a peer's rows to that peer and flags it, and waits for the peers' flags
//   of each tile of our rows before adding their partials (fused_rs_sm90.cuh).
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
  bool fused = false;        // matmul_reduce_scatter: one GEMM with a scattering epilogue
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

// The fused matmul_reduce_scatter's output tile (DefaultTiles; checked where
// the kernel is built) and its per-tile flags: rank q's region holds n slots,
// then flags[n][tiles] (8 bytes each), flags[s][t] = the epoch of the last
// call in which sender s wrote its partial of our tile t.
inline constexpr int kFusedTileM = 128;
inline constexpr int kFusedTileN = 256;
inline int64_t fused_rs_tiles_n(int64_t n_cols) {
  return (n_cols + kFusedTileN - 1) / kFusedTileN;
}
inline int64_t fused_rs_tiles(int64_t m, int64_t n_cols) {
  return (m / kFusedTileM) * fused_rs_tiles_n(n_cols);
}
inline size_t fused_rs_flags_offset(int n, int64_t m, int64_t n_cols, gemm::DType out) {
  return (matmul_rs_region_bytes(n, m, n_cols, out) + 255) / 256 * 256;
}
inline size_t fused_rs_region_bytes(int n, int64_t m, int64_t n_cols, gemm::DType out) {
  return fused_rs_flags_offset(n, m, n_cols, out) + size_t(n) * fused_rs_tiles(m, n_cols) * 8;
}
// What the fused path takes: two or more ranks, 16-bit output of the input
// type, shard rows a multiple of the tile (no tile straddles two shards).
inline bool fused_rs_supported(const Params& p) {
  return p.n > 1 && p.out_type == p.in && p.in != gemm::DType::kF32 && p.m % kFusedTileM == 0;
}

// Where the fused kernel's epilogue sends each tile (rank r of n, call epoch
// from the channel). Rows [q*m, (q+1)*m) of x @ w are rank q's: for q != r
// they go to slot r of q's region and flags_remote[q][r*tiles + t] is set;
// ours wait for flags_local[s*tiles + t] of every sender s, add their slots
// and go to out.
struct ScatterTarget {
  void* out = nullptr;
  char* remote[kMaxRanks] = {};           // slot r of rank q's region
  const char* slots = nullptr;            // our region: slot s from sender s
  uint64_t* flags_remote[kMaxRanks] = {}; // rank q's flags (all senders)
  const uint64_t* flags_local = nullptr;
  Channel ch{};
  int64_t m = 0;       // rows per shard
  int64_t n_cols = 0;  // N
  int64_t tiles = 0;   // output tiles per shard
  int64_t tiles_n = 0; // along N
  int rank = 0;
  int n = 1;
  bool skip_post = false;
};

// The fused GEMM (fused_rs.cu): D = x @ w over all n*m rows, tiles scattered.
cudaError_t run_fused_rs(const Params& p, const ScatterTarget& t, cudaStream_t s);

cudaError_t all_gather_matmul(const Params& p);
cudaError_t matmul_reduce_scatter(const Params& p);

// Load the helper kernels and the fused GEMMs on the current device.
cudaError_t load_kernels();
cudaError_t load_fused_rs_kernels();

}  // namespace pk::tp_matmul
