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
//   with more, it fills our slot and a sum of the n slots follows.
// matmul_all_reduce: out[M, N] = sum_q (x_q @ w_q), the same bits on every rank
//   (Params::mechanism)
//   chunked: matmul_reduce_scatter's sequence reduces our chunk of rows (its
//   owner, in one fixed order), in row pieces with two ranks; as each piece
//   lands the side stream's copy engine pushes it into every peer's gather
//   region (a second channel), and each rank copies the peers' chunks into
//   place;
//   one_shot (decode-sized M): one GEMM of all rows, its partial pushed to
//   every peer, and every rank sums the n partials in rank order (fp32).
// The backward passes (Params::dw set) also compute the weight gradient
// dw [N, K] = act^T [N, n*m] @ rows [n*m, K] in the same call (N = n_cols,
// K = k here; act the forward's activations, rows all the group's rows of x,
// one GEMM over the whole contraction, fp32 accumulation), placed where the
// sequence would otherwise wait:
//   matmul_reduce_scatter (the backward of all_gather_matmul): after the
//   remote GEMMs and posts, before the wait for the peers' partials (it
//   hides the peers' skew and the drain of the NVLink stores); rows = x;
//   all_gather_matmul (the backward of matmul_reduce_scatter): after the
//   GEMMs of the landed rows; our own rows are copied into our own slot by
//   the side stream, so our region holds all the rows and the dW GEMM reads
//   them there.
// FP8 (Params::in e4m3 or e5m2): the same sequences on FP8 operands with
// their dequantization factors (Params::scaling; kernels/gemm: gemm.h's
// Scaling), w given transposed [N, K] (K-major, as the FP8 tensor cores read
// it); x's rows travel as FP8 (all_gather_matmul), the partial products in
// the output type. Per-tensor (kTensor): one factor each, the GEMMs'
// epilogue scales. Block (kBlock, e4m3): w's per 128x128, the same for every
// GEMM; x's per 1x128, each GEMM of a group of x's rows reading the group's
// factors [ceil(K / 128), rows] contiguous (Params::scale_x): x's factors
// come in the row groups of the sequence's GEMMs, and all_gather_matmul's
// rows travel with their factors, after them in the same slot (one post per
// slot, its layout counting both). Chunked matmul_all_reduce then reduces
// its chunk in one piece (a piece's factors are not contiguous). No weight
// gradient in the same call.
// All: every GEMM of the call is checked (gemm::check) before anything is
// enqueued, and the call always ends in signals::finish (also with one rank,
// and after a CUDA error from an enqueue, as aborted): the outputs of a call
// that failed are poison (NaN), whatever stage it failed in.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemm/gemm.h"
#include "pk/channel.h"
#include "pk/layout.h"
#include "pk/signals.h"

namespace pk::tp_matmul {

// The op whose sequence run() enqueues: the three share Params (each file's
// sequence reads the members it needs).
enum class Op : int32_t { kAllGatherMatmul = 0, kMatmulReduceScatter = 1, kMatmulAllReduce = 2 };

// matmul_all_reduce's sequences: values of its FFI attribute "mechanism"
// (pk_jax/ops/tp_matmul/primitive.py: ALL_REDUCE_KERNEL_MECHANISMS). The
// other ops run the chunked sequences only and take no mechanism.
enum class AllReduceMechanism : int32_t { kChunked = 0, kOneShot = 1 };
inline bool is_all_reduce_mechanism(int32_t v) {
  return v == int32_t(AllReduceMechanism::kChunked) || v == int32_t(AllReduceMechanism::kOneShot);
}

struct Params {
  Op op = Op::kAllGatherMatmul;
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
  // FP8 (in e4m3 or e5m2): w's type, the scaling (kTensor or kBlock) and
  // the factors of x and w on the device. kTensor: one float each. kBlock:
  // w's per 128x128 [ceil(k / 128), ceil(n_cols / 128)]; x's per 1x128 in
  // the row groups of the sequence's GEMMs, each group of g consecutive rows
  // [ceil(k / 128), g] contiguous, the groups back to back (g = m: each
  // chunk of m rows; one_shot and one rank: g = all rows; all_gather_matmul:
  // x is one group), so the group at row `first` starts at scale_x + first *
  // ceil(k / 128) (x_factors).
  gemm::DType in_w = gemm::DType::kE4M3;
  gemm::Scaling scaling = gemm::Scaling::kNone;
  gemm::Library library = gemm::Library::kCutlass;  // kTensor's GEMMs (gemm.h)
  bool fast_accum = false;  // kTensor: gemm::Problem::fast_accum
  const float* scale_x = nullptr;
  const float* scale_w = nullptr;
  int rank = 0;
  int n = 1;
  Channel ch{};
  // The channel's data region on every rank (n > 1): n slots of one rank's
  // block, x [m, K] for all_gather_matmul (kBlock: followed by its factors
  // [ceil(K / 128), m]), the output shard [m, N] for matmul_reduce_scatter
  // (with n = 2 our own slot stays unused).
  char* region[kMaxRanks] = {};
  // matmul_all_reduce: kChunked: the reduced chunks travel on a second
  // channel (its own epochs and posts), one slot of [m, N] per rank in its
  // region; kOneShot: m = all the rows, each rank's partial product staged in
  // `region` and no second channel.
  AllReduceMechanism mechanism = AllReduceMechanism::kChunked;
  Channel gather_ch{};
  char* gather_region[kMaxRanks] = {};
  // Backward passes: the weight gradient dw [n_cols, k] (input type) of the
  // forward's activations `act` [n * m, n_cols]; null: none.
  void* dw = nullptr;
  const void* act = nullptr;
  bool skip_post = false;
  gemm::Device gemm_dev{};
  cudaStream_t stream = nullptr;
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

// FP8 operands with block factors (Params::scaling).
inline bool block_scaled(const Params& p) { return p.scaling == gemm::Scaling::kBlock; }

// How many 1x128 factors one row of x has with kBlock: ceil(k / 128).
inline int64_t k_blocks(const Params& p) { return gemm::scale_blocks(p.k); }

// The bytes of the block factors of `rows` rows of x (0 unless kBlock).
inline size_t x_factor_bytes(const Params& p, int64_t rows) {
  return block_scaled(p) ? size_t(rows) * size_t(k_blocks(p)) * sizeof(float) : 0;
}

// The factors of the GEMM's A at x's row `first` (a row group's first row
// with kBlock: Params::scale_x), or the one factor of x (kTensor).
inline const float* x_factors(const Params& p, int64_t first) {
  return block_scaled(p) ? p.scale_x + first * k_blocks(p) : p.scale_x;
}

// The GEMM of `rows` rows at `a` [rows, k] (input type; FP8: with their
// factors `a_factors`, gemm.h's Scaling) @ w, + `add` [rows, n_cols] of the
// output type (the epilogue's C) when given, -> dst [rows, n_cols] of the
// output type.
inline gemm::Problem rows_gemm(const Params& p, const void* a, const float* a_factors,
                               int64_t rows, void* dst, const void* add = nullptr) {
  gemm::Problem g;
  g.m = rows;
  g.n = p.n_cols;
  g.k = p.k;
  g.a = a;
  g.b = p.w;
  g.b_transposed = p.w_transposed;
  g.c = add;
  g.d = dst;
  g.in = p.in;
  g.out = p.out_type;
  if (gemm::is_fp8(p.in)) {
    g.in_b = p.in_w;
    g.scaling = p.scaling;
    g.library = p.library;
    g.fast_accum = p.fast_accum;
    g.scale_a = a_factors;
    g.scale_b = p.scale_w;
  }
  return g;
}

// x[first, first + rows) @ w (+ add) -> dst; kBlock: rows one row group of
// x's factors, first its first row.
inline gemm::Problem x_rows_gemm(const Params& p, int64_t first, int64_t rows, void* dst,
                                 const void* add = nullptr) {
  return rows_gemm(p, static_cast<const char*>(p.x) + size_t(first) * size_t(p.k) *
                                                          gemm::itemsize(p.in),
                   x_factors(p, first), rows, dst, add);
}

// The weight gradient's GEMM (p.dw set): dw = p.act^T @ rows, rows
// [n * m, k] in rank order.
inline gemm::Problem weight_grad(const Params& p, const void* rows) {
  gemm::Problem g;
  g.m = p.n_cols;
  g.n = p.k;
  g.k = int64_t(p.n) * p.m;
  g.a = p.act;
  g.a_transposed = true;
  g.b = rows;
  g.d = p.dw;
  g.in = p.in;
  g.out = p.in;
  return g;
}

inline size_t weight_grad_bytes(const Params& p) {
  return p.dw ? size_t(p.n_cols) * size_t(p.k) * gemm::itemsize(p.in) : 0;
}

// What the sequences' posts carry (signals::PostLayout): x's rows, each with
// its block factors (all_gather_matmul), or rows of the output type (the
// others' partial products and reduced chunks).
inline signals::PostLayout x_rows_layout(const Params& p) {
  return {uint64_t(p.m), uint64_t(p.k) * gemm::itemsize(p.in) + x_factor_bytes(p, 1)};
}
inline signals::PostLayout out_rows_layout(const Params& p) {
  return {uint64_t(p.m), uint64_t(p.n_cols) * gemm::itemsize(p.out_type)};
}

// The whole call of op p.op (tp_matmul.cu): its sequence below.
// cudaErrorInvalidValue, with nothing enqueued, for an unknown op or
// matmul_all_reduce mechanism.
cudaError_t run(const Params& p);

// ---- the sequences, one file each (<op>.cu), for run() --------------------
cudaError_t all_gather_matmul(const Params& p);
cudaError_t matmul_reduce_scatter(const Params& p);
cudaError_t matmul_all_reduce(const Params& p);  // by p.mechanism

// out = the sum over q < p.n of the slots (p.m x p.n_cols of the output type
// each, back to back from `slots`), accumulated in fp32 in rank order; with
// wait_posted, after a bounded wait for every peer's post on p.ch and the
// check of its layout (out_rows_layout), as signals::wait_posted, in the
// same launch.
cudaError_t launch_sum_slots(const Params& p, const char* slots, cudaStream_t s,
                             bool wait_posted = false);

// Load the helper kernels (the slot sum) on the current device.
cudaError_t load_kernels();

}  // namespace pk::tp_matmul
