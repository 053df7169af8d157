// matmul_reduce_scatter on one stream (see tp_matmul.h). For call epoch e on
// rank r, with m = rows of the output shard:
//   credit: every peer finished summing what we wrote into its region last call.
//   remote: for each peer q, nearest first: GEMM x[q's rows] @ w with its
//           output in slot r of q's region (the epilogue's stores cross
//           NVLink while the next GEMM computes), then post q.
//   local:  n = 2: wait posted[q] >= e, then GEMM x[our rows] @ w + the
//           peer's slot (the epilogue's C, summed in fp32) -> out. No sum pass.
//           n > 2: GEMM x[our rows] @ w -> slot r of our region; wait every
//           peer; out = sum of the n slots, accumulated in fp32 (one rounding
//           of each partial, as with n = 2).
//   dW:     with p.dw (the backward of all_gather_matmul): dw = act^T @ x,
//           local and long, between the last post and the wait (n = 2), or
//           between our own GEMM and the wait (n > 2): it runs while the
//           peers catch up and our stores drain.
//   finish: done[r] = e to every peer (our slots may be overwritten), the
//           outputs (and dw) poisoned if the call failed, epoch = e. With one
//           rank: the GEMM (and the dW GEMM), then finish.
// Every GEMM of the call is checked before anything is enqueued; a CUDA
// error from an enqueue still finishes the call, as aborted.
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {
namespace {

size_t slot_bytes(const Params& p) {
  return size_t(p.m) * size_t(p.n_cols) * gemm::itemsize(p.out_type);
}

// Every GEMM of the call, in order: q's rows into q's region (q != r), then
// ours. `i` walks them; false after the last.
bool problem(const Params& p, int i, gemm::Problem* g) {
  const size_t slot = slot_bytes(p);
  if (p.n == 1) {
    if (i > 0) return false;
    *g = x_rows_gemm(p, 0, p.m, p.out);
    return true;
  }
  if (i < p.n - 1) {
    const int q = (p.rank + 1 + i) % p.n;
    *g = x_rows_gemm(p, q * p.m, p.m, p.region[q] + size_t(p.rank) * slot);
    return true;
  }
  if (i > p.n - 1) return false;
  if (p.n == 2)
    *g = x_rows_gemm(p, p.rank * p.m, p.m, p.out,
                     p.region[p.rank] + size_t(1 - p.rank) * slot);
  else
    *g = x_rows_gemm(p, p.rank * p.m, p.m, p.region[p.rank] + size_t(p.rank) * slot);
  return true;
}

// The dW GEMM where the sequence would wait (none without p.dw).
cudaError_t weight_grad_gemm(const Params& p, cudaStream_t s) {
  if (p.dw == nullptr) return cudaSuccess;
  return gemm::run(weight_grad(p, p.x), p.gemm_dev, s);
}

cudaError_t enqueue(const Params& p) {
  cudaStream_t s = p.stream;
  gemm::Problem g;
  if (p.n == 1) {
    problem(p, 0, &g);
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    return weight_grad_gemm(p, s);
  }
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    problem(p, k - 1, &g);
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    PK_CUDA_TRY(signals::post(p.ch, q, out_rows_layout(p), p.skip_post, s));
  }
  problem(p, p.n - 1, &g);
  if (p.n == 2) {
    PK_CUDA_TRY(weight_grad_gemm(p, s));
    PK_CUDA_TRY(signals::wait_posted(p.ch, 1 - p.rank, out_rows_layout(p), s));
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
  } else {
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    PK_CUDA_TRY(weight_grad_gemm(p, s));
    PK_CUDA_TRY(signals::wait_posted(p.ch, signals::kAllPeers, out_rows_layout(p), s));
    PK_CUDA_TRY(launch_sum_slots(p, p.region[p.rank], s));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t matmul_reduce_scatter(const Params& p) {
  // Refuse before the first enqueue: a GEMM CUTLASS would reject.
  gemm::Problem g;
  for (int i = 0; problem(p, i, &g); ++i) PK_CUDA_TRY(gemm::check(g, p.gemm_dev));
  if (p.dw != nullptr) PK_CUDA_TRY(gemm::check(weight_grad(p, p.x), p.gemm_dev));
  signals::Outputs out(p.out, slot_bytes(p));
  out.add(p.dw, weight_grad_bytes(p));
  return signals::finish_after(enqueue(p), p.ch, out, p.stream);
}

}  // namespace pk::tp_matmul
