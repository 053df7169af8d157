// all_gather_matmul: copy engines move x on the side stream while the GEMMs
// run on the main stream (see tp_matmul.h). For call epoch e on rank r:
//   side:  credit (every peer finished its GEMMs on what we pushed last call),
//          then for each peer q, nearest first: CE copy x -> slot r of q's
//          region, post q. Also x -> our rows of `gathered` when asked.
//   main:  GEMM on x -> our rows of out; then for each peer q in the order
//          their copies reach us: wait posted[q] >= e, GEMM on slot q -> q's
//          rows (and slot q -> q's rows of `gathered`).
//   end:   join the side stream, finish (done[r] = e to every peer: our slots
//          may be overwritten; epoch = e).
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {
namespace {

cudaError_t gemm_rows(const Params& p, const void* rows, int q, cudaStream_t s) {
  gemm::Problem g;
  g.m = p.m;
  g.n = p.n_cols;
  g.k = p.k;
  g.a = rows;
  g.b = p.w;
  g.b_transposed = p.w_transposed;
  g.d = static_cast<char*>(p.out) + size_t(q) * p.m * p.n_cols * gemm::itemsize(p.out_type);
  g.in = p.in;
  g.out = p.out_type;
  return gemm::run(g, p.gemm_dev, s);
}

cudaError_t copy_gathered(const Params& p, const void* rows, int q, cudaStream_t s) {
  if (p.gathered == nullptr) return cudaSuccess;
  const size_t bytes = size_t(p.m) * p.k * gemm::itemsize(p.in);
  return cudaMemcpyAsync(static_cast<char*>(p.gathered) + q * bytes, rows, bytes,
                         cudaMemcpyDeviceToDevice, s);
}

}  // namespace

cudaError_t all_gather_matmul(const Params& p) {
  const size_t block = size_t(p.m) * p.k * gemm::itemsize(p.in);
  cudaStream_t s = p.stream, side = p.side_stream;
  if (p.n > 1) {
    PK_CUDA_TRY(cudaEventRecord(p.fork, s));
    PK_CUDA_TRY(cudaStreamWaitEvent(side, p.fork, 0));
    PK_CUDA_TRY(signals::wait_credit(p.ch, side));
    for (int k = 1; k < p.n; ++k) {
      const int q = (p.rank + k) % p.n;
      PK_CUDA_TRY(cudaMemcpyAsync(p.region[q] + p.rank * block, p.x, block,
                                  cudaMemcpyDeviceToDevice, side));
      PK_CUDA_TRY(signals::post(p.ch, q, p.skip_post, side));
    }
    PK_CUDA_TRY(copy_gathered(p, p.x, p.rank, side));
  } else {
    PK_CUDA_TRY(copy_gathered(p, p.x, p.rank, s));
  }
  PK_CUDA_TRY(gemm_rows(p, p.x, p.rank, s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + p.n - k) % p.n;  // q pushes to us at its k-th step
    const char* slot = p.region[p.rank] + q * block;
    PK_CUDA_TRY(signals::wait_posted(p.ch, q, s));
    PK_CUDA_TRY(gemm_rows(p, slot, q, s));
    PK_CUDA_TRY(copy_gathered(p, slot, q, s));
  }
  if (p.n == 1) return cudaSuccess;
  PK_CUDA_TRY(cudaEventRecord(p.join, side));
  PK_CUDA_TRY(cudaStreamWaitEvent(s, p.join, 0));
  return signals::finish(p.ch, s);
}

}  // namespace pk::tp_matmul
