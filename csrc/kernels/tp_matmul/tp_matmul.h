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
// FP8 (Params::in e4m3 or e5m2): the same sequences on FP8 operands with one
// dequantization factor each (per-tensor scaling, the GEMMs' epilogue scales;
// kernels/gemm: gemm.h), w given transposed [N, K] (K-major, as the FP8
// tensor cores read it); x's rows travel as FP8 (all_gather_matmul), the
// partial products in the output type. No weight gradient in the same call.
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
  // FP8 (in e4m3 or e5m2): w's type and the factors of x and w (one float
  // each, on the device).
  gemm::DType in_w = gemm::DType::kE4M3;
  const float* scale_x = nullptr;
  const float* scale_w = nullptr;
  int rank = 0;
  int n = 1;
  Channel ch{};
  // The channel's data region on every rank (n > 1): n slots of one rank's
  // block, x [m, K] for all_gather_matmul, the output shard [m, N] for
  // matmul_reduce_scatter (with n = 2 our own slot stays unused).
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

// The GEMM of `rows` rows at `a` [rows, k] (input type) @ w, + `add`
// [rows, n_cols] of the output type (the epilogue's C) when given, -> dst
// [rows, n_cols] of the output type.
inline gemm::Problem rows_gemm(const Params& p, const void* a, int64_t rows, void* dst,
                               const void* add = nullptr) {
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
    g.scaling = gemm::Scaling::kTensor;
    g.scale_a = p.scale_x;
    g.scale_b = p.scale_w;
  }
  return g;
}

// x[first, first + rows) @ w (+ add) -> dst.
inline gemm::Problem x_rows_gemm(const Params& p, int64_t first, int64_t rows, void* dst,
                                 const void* add = nullptr) {
  return rows_gemm(p, static_cast<const char*>(p.x) + size_t(first) * size_t(p.k) *
                                                          gemm::itemsize(p.in),
                   rows, dst, add);
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

// What the sequences' posts carry (signals::PostLayout): x's rows
// (all_gather_matmul) or rows of the output type (the others' partial
// products and reduced chunks).
inline signals::PostLayout x_rows_layout(const Params& p) {
  return {uint64_t(p.m), uint64_t(p.k) * gemm::itemsize(p.in)};
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
