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
//   finish: done[r] = e to every peer (our slots may be overwritten), epoch = e.
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {

cudaError_t launch_sum_slots(const Params& p, const char* slots, cudaStream_t s);

namespace {

cudaError_t gemm_into(const Params& p, int rows_of, char* dst, cudaStream_t s,
                      const char* add = nullptr) {
  gemm::Problem g;
  g.m = p.m;
  g.n = p.n_cols;
  g.k = p.k;
  g.a = static_cast<const char*>(p.x) + size_t(rows_of) * p.m * p.k * gemm::itemsize(p.in);
  g.b = p.w;
  g.b_transposed = p.w_transposed;
  g.c = add;
  g.d = dst;
  g.in = p.in;
  g.out = p.out_type;
  return gemm::run(g, p.gemm_dev, s);
}

}  // namespace

cudaError_t matmul_reduce_scatter(const Params& p) {
  cudaStream_t s = p.stream;
  if (p.n == 1) return gemm_into(p, 0, static_cast<char*>(p.out), s);
  const size_t slot = size_t(p.m) * p.n_cols * gemm::itemsize(p.out_type);
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    PK_CUDA_TRY(gemm_into(p, q, p.region[q] + p.rank * slot, s));
    PK_CUDA_TRY(signals::post(p.ch, q, p.skip_post, s));
  }
  if (p.n == 2) {
    const int peer = 1 - p.rank;
    PK_CUDA_TRY(signals::wait_posted(p.ch, peer, s));
    PK_CUDA_TRY(gemm_into(p, p.rank, static_cast<char*>(p.out), s,
                          p.region[p.rank] + peer * slot));
  } else {
    PK_CUDA_TRY(gemm_into(p, p.rank, p.region[p.rank] + p.rank * slot, s));
    PK_CUDA_TRY(signals::wait_posted(p.ch, signals::kAllPeers, s));
    PK_CUDA_TRY(launch_sum_slots(p, p.region[p.rank], s));
  }
  return signals::finish(p.ch, s);
}

}  // namespace pk::tp_matmul
