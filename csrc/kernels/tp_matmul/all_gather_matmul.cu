// all_gather_matmul: copy engines move x on the side stream while the GEMMs
// run on the main stream (see tp_matmul.h). For call epoch e on rank r:
//   side:  credit (every peer finished its GEMMs on what we pushed last call),
//          then for each peer q, nearest first: CE copy x (and with block
//          factors x's factors, after the rows) -> slot r of q's region, post
//          q. Also x -> our rows of `gathered` when asked.
//   main:  GEMM on x -> our rows of out; then for each peer q in the order
//          their copies reach us: wait posted[q] >= e, GEMM on slot q -> q's
//          rows (and slot q -> q's rows of `gathered`).
//   dW:    with p.dw (the backward of matmul_reduce_scatter): the side stream
//          also copies x into slot r of our own region, so the region holds
//          every rank's rows in rank order; after the last GEMM of landed
//          rows, join the side stream and dw = act^T @ region (with one
//          rank: act^T @ x). Nothing left to wait on by then.
//   end:   join the side stream, finish (done[r] = e to every peer: our slots
//          may be overwritten; the outputs poisoned if the call failed;
//          epoch = e). With one rank: the GEMM (and copy), then finish.
// Every GEMM of the call is checked before anything is enqueued; a CUDA
// error from an enqueue still joins the side stream and finishes the call,
// as aborted (signals::finish, which also poisons dw), so the protocol never
// stops halfway.
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {
namespace {

// One rank's rows x [m, k]; a slot of the region: the rows, then with block
// factors their factors [ceil(k / 128), m] (tp_matmul.h: Params::region).
size_t rows_bytes(const Params& p) { return size_t(p.m) * size_t(p.k) * gemm::itemsize(p.in); }
size_t slot_bytes(const Params& p) { return rows_bytes(p) + x_factor_bytes(p, p.m); }

// Our rows come from x, peer q's from slot q of our region.
const void* rows_of(const Params& p, int q) {
  return q == p.rank ? p.x : p.region[p.rank] + size_t(q) * slot_bytes(p);
}

// The factors of rank q's rows: x's (ours; kTensor: x's one factor for
// every rank's rows), or with block factors those after the rows in slot q.
const float* factors_of(const Params& p, int q) {
  if (q == p.rank || !block_scaled(p)) return p.scale_x;
  return reinterpret_cast<const float*>(static_cast<const char*>(rows_of(p, q)) + rows_bytes(p));
}

// Rank q's rows @ w -> q's rows of out.
gemm::Problem rows_problem(const Params& p, int q) {
  return rows_gemm(p, rows_of(p, q), factors_of(p, q), p.m,
                   static_cast<char*>(p.out) + size_t(q) * size_t(p.m) * size_t(p.n_cols) *
                                                   gemm::itemsize(p.out_type));
}

// x (and with block factors x's factors, after the rows) -> slot r of q's
// region, on the side stream.
cudaError_t push_rows(const Params& p, int q) {
  char* slot = p.region[q] + size_t(p.rank) * slot_bytes(p);
  PK_CUDA_TRY(cudaMemcpyAsync(slot, p.x, rows_bytes(p), cudaMemcpyDeviceToDevice,
                              p.side_stream));
  if (!block_scaled(p)) return cudaSuccess;
  return cudaMemcpyAsync(slot + rows_bytes(p), p.scale_x, x_factor_bytes(p, p.m),
                         cudaMemcpyDeviceToDevice, p.side_stream);
}

cudaError_t copy_gathered(const Params& p, const void* rows, int q, cudaStream_t s) {
  if (p.gathered == nullptr) return cudaSuccess;
  const size_t bytes = rows_bytes(p);
  return cudaMemcpyAsync(static_cast<char*>(p.gathered) + size_t(q) * bytes, rows, bytes,
                         cudaMemcpyDeviceToDevice, s);
}

// The dW GEMM reads every rank's rows from our region (n > 1; 16-bit calls:
// the slots hold the rows alone, back to back).
gemm::Problem weight_grad_problem(const Params& p) {
  return weight_grad(p, p.n > 1 ? static_cast<const void*>(p.region[p.rank]) : p.x);
}

// Everything up to the join; *forked once the side stream waits on ours.
cudaError_t enqueue(const Params& p, bool* forked) {
  cudaStream_t s = p.stream, side = p.side_stream;
  if (p.n > 1) {
    PK_CUDA_TRY(cudaEventRecord(p.fork, s));
    PK_CUDA_TRY(cudaStreamWaitEvent(side, p.fork, 0));
    *forked = true;
    PK_CUDA_TRY(signals::wait_credit(p.ch, side));
    for (int k = 1; k < p.n; ++k) {
      const int q = (p.rank + k) % p.n;
      PK_CUDA_TRY(push_rows(p, q));
      PK_CUDA_TRY(signals::post(p.ch, q, x_rows_layout(p), p.skip_post, side));
    }
    PK_CUDA_TRY(copy_gathered(p, p.x, p.rank, side));
    if (p.dw != nullptr)  // our rows into our own slot, for the dW GEMM
      PK_CUDA_TRY(cudaMemcpyAsync(p.region[p.rank] + size_t(p.rank) * rows_bytes(p), p.x,
                                  rows_bytes(p), cudaMemcpyDeviceToDevice, side));
  } else {
    PK_CUDA_TRY(copy_gathered(p, p.x, p.rank, s));
  }
  PK_CUDA_TRY(gemm::run(rows_problem(p, p.rank), p.gemm_dev, s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + p.n - k) % p.n;  // q pushes to us at its k-th step
    PK_CUDA_TRY(signals::wait_posted(p.ch, q, x_rows_layout(p), s));
    PK_CUDA_TRY(gemm::run(rows_problem(p, q), p.gemm_dev, s));
    PK_CUDA_TRY(copy_gathered(p, rows_of(p, q), q, s));
  }
  if (p.dw == nullptr) return cudaSuccess;
  if (p.n > 1) {  // our own slot is the side stream's last copy
    PK_CUDA_TRY(cudaEventRecord(p.join, side));
    PK_CUDA_TRY(cudaStreamWaitEvent(s, p.join, 0));
  }
  return gemm::run(weight_grad_problem(p), p.gemm_dev, s);
}

}  // namespace

cudaError_t all_gather_matmul(const Params& p) {
  // Refuse before the first enqueue: a GEMM CUTLASS would reject.
  for (int q = 0; q < p.n; ++q) PK_CUDA_TRY(gemm::check(rows_problem(p, q), p.gemm_dev));
  if (p.dw != nullptr) PK_CUDA_TRY(gemm::check(weight_grad_problem(p), p.gemm_dev));
  signals::Outputs out(p.out, size_t(p.n) * size_t(p.m) * size_t(p.n_cols) *
                                  gemm::itemsize(p.out_type));
  out.add(p.gathered, size_t(p.n) * rows_bytes(p));
  out.add(p.dw, weight_grad_bytes(p));
  bool forked = false;
  cudaError_t err = enqueue(p, &forked);
  if (forked) err = signals::join(err, p.join, p.side_stream, p.stream);
  return signals::finish_after(err, p.ch, out, p.stream);
}

}  // namespace pk::tp_matmul
