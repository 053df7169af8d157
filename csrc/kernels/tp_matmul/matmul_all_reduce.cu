// matmul_all_reduce on one stream (see tp_matmul.h): out = psum(x @ w), the
// same bits on every rank. Two host sequences.
//
// chunked, for call epoch e on rank r, m = M / n rows per chunk:
//   reduce (channel ch, region: n slots of [m, N]), as matmul_reduce_scatter:
//     credit: every peer finished summing what we wrote into its region last call.
//     remote: for each peer q, nearest first: GEMM x[q's rows] @ w with its
//             output in slot r of q's region (the epilogue's stores cross
//             NVLink), then post q.
//     local:  n = 2: wait the peer, GEMM x[our rows] @ w + its slot (the
//             epilogue's C, fp32) -> our rows of out. n > 2: GEMM -> slot r
//             of our region, wait every peer, sum the n slots in rank order
//             (fp32) -> our rows of out. Chunk r is reduced once, by r.
//     finish ch: done[r] = e to every peer; out poisoned if the call failed
//             so far (a failed chunk then travels as NaN, never as numbers).
//   gather (channel gather_ch, region: n slots of [m, N]):
//     credit: every peer finished copying out what we pushed last call.
//     push:   for each peer q: copy engine, our rows of out -> slot r of q's
//             region (one 1-D copy: the rows are contiguous), post q.
//     pull:   for each peer q, in the order their pushes reach us: wait
//             posted[q] >= e, copy slot q of our region -> q's rows of out.
//     finish gather_ch (outputs poisoned if anything failed).
// one_shot (decode-sized M; channel ch, region: n slots of [M, N]):
//   GEMM x @ w -> slot r of our region; credit; for each peer q: copy engine
//   slot r -> slot r of q's region, post q; wait every peer; out = the sum of
//   the n slots in rank order (fp32); finish.
// With one rank: the GEMM into out, then finish. Every GEMM of the call is
// checked before anything is enqueued; a CUDA error from an enqueue still
// finishes every channel the call uses, as aborted.
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {
namespace {

// ---- layout ----------------------------------------------------------------
size_t slot_bytes(const Params& p) {
  return size_t(p.m) * size_t(p.n_cols) * gemm::itemsize(p.out_type);
}

char* slot(char* region, const Params& p, int q) { return region + size_t(q) * slot_bytes(p); }

char* out_rows(const Params& p, int q) {
  return static_cast<char*>(p.out) + (p.one_shot ? 0 : size_t(q) * slot_bytes(p));
}

size_t out_bytes(const Params& p) { return p.one_shot ? slot_bytes(p) : p.n * slot_bytes(p); }

gemm::Problem into(const Params& p, int rows_of, void* dst, const void* add = nullptr) {
  gemm::Problem g;
  g.m = p.m;
  g.n = p.n_cols;
  g.k = p.k;
  g.a = static_cast<const char*>(p.x) +
        size_t(rows_of) * size_t(p.m) * size_t(p.k) * gemm::itemsize(p.in);
  g.b = p.w;
  g.b_transposed = p.w_transposed;
  g.c = add;
  g.d = dst;
  g.in = p.in;
  g.out = p.out_type;
  return g;
}

// Every GEMM of the call, in order; `i` walks them, false after the last.
//   one rank: all rows -> out. one_shot: all rows -> slot r of our region.
//   chunked: q's rows into q's region for the peers nearest first, then ours.
bool problem(const Params& p, int i, gemm::Problem* g) {
  if (p.n == 1 || p.one_shot) {
    if (i > 0) return false;
    *g = into(p, 0, p.n == 1 ? p.out : slot(p.region[p.rank], p, p.rank));
    return true;
  }
  if (i < p.n - 1) {
    const int q = (p.rank + 1 + i) % p.n;
    *g = into(p, q, slot(p.region[q], p, p.rank));
    return true;
  }
  if (i > p.n - 1) return false;
  if (p.n == 2)
    *g = into(p, p.rank, out_rows(p, p.rank), slot(p.region[p.rank], p, 1 - p.rank));
  else
    *g = into(p, p.rank, slot(p.region[p.rank], p, p.rank));
  return true;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
}

// ---- roles -----------------------------------------------------------------
// Pushes `src` (one slot) into slot r of every peer's `regions`, each posted.
cudaError_t push_to_peers(const Params& p, const Channel& ch, char* const* regions,
                          const void* src, cudaStream_t s) {
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    PK_CUDA_TRY(copy(slot(regions[q], p, p.rank), src, slot_bytes(p), s));
    PK_CUDA_TRY(signals::post(ch, q, p.skip_post, s));
  }
  return cudaSuccess;
}

// Sums the n slots of our region into `dst` (fp32, rank order).
cudaError_t sum_into(const Params& p, void* dst, cudaStream_t s) {
  Params chunk = p;
  chunk.out = dst;
  return launch_sum_slots(chunk, p.region[p.rank], s);
}

cudaError_t one_shot(const Params& p) {
  cudaStream_t s = p.stream;
  gemm::Problem g;
  problem(p, 0, &g);
  PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
  // Only our own slot so far: the credit wait overlaps the GEMM's tail.
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  PK_CUDA_TRY(push_to_peers(p, p.ch, p.region, g.d, s));
  PK_CUDA_TRY(signals::wait_posted(p.ch, signals::kAllPeers, s));
  return sum_into(p, p.out, s);
}

// The reduce stage of the chunked sequence: our rows of out, reduced.
cudaError_t reduce_chunk(const Params& p) {
  cudaStream_t s = p.stream;
  gemm::Problem g;
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  for (int k = 1; k < p.n; ++k) {
    problem(p, k - 1, &g);
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    PK_CUDA_TRY(signals::post(p.ch, (p.rank + k) % p.n, p.skip_post, s));
  }
  problem(p, p.n - 1, &g);
  if (p.n == 2) {
    PK_CUDA_TRY(signals::wait_posted(p.ch, 1 - p.rank, s));
    return gemm::run(g, p.gemm_dev, s);
  }
  PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
  PK_CUDA_TRY(signals::wait_posted(p.ch, signals::kAllPeers, s));
  return sum_into(p, out_rows(p, p.rank), s);
}

// The gather stage: every peer's reduced rows into place.
cudaError_t gather_chunks(const Params& p) {
  cudaStream_t s = p.stream;
  PK_CUDA_TRY(signals::wait_credit(p.gather_ch, s));
  PK_CUDA_TRY(push_to_peers(p, p.gather_ch, p.gather_region, out_rows(p, p.rank), s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + p.n - k) % p.n;  // q pushes to us at its k-th step
    PK_CUDA_TRY(signals::wait_posted(p.gather_ch, q, s));
    PK_CUDA_TRY(copy(out_rows(p, q), slot(p.gather_region[p.rank], p, q), slot_bytes(p), s));
  }
  return cudaSuccess;
}

}  // namespace

// ---- entry point -----------------------------------------------------------
cudaError_t matmul_all_reduce(const Params& p) {
  // Refuse before the first enqueue: a GEMM CUTLASS would reject.
  gemm::Problem g;
  for (int i = 0; problem(p, i, &g); ++i) PK_CUDA_TRY(gemm::check(g, p.gemm_dev));
  const signals::Outputs out(p.out, out_bytes(p));
  cudaStream_t s = p.stream;
  if (p.n == 1 || p.one_shot) {
    problem(p, 0, &g);
    const cudaError_t err = p.n == 1 ? gemm::run(g, p.gemm_dev, s) : one_shot(p);
    if (err != cudaSuccess) {
      signals::finish(p.ch, out, s, /*aborted=*/true);  // best effort
      return err;
    }
    return signals::finish(p.ch, out, s);
  }
  if (cudaError_t err = reduce_chunk(p); err != cudaSuccess) {
    signals::finish(p.ch, out, s, /*aborted=*/true);  // best effort, both channels
    signals::finish(p.gather_ch, out, s, /*aborted=*/true);
    return err;
  }
  cudaError_t err = signals::finish(p.ch, out, s);
  if (err == cudaSuccess) err = gather_chunks(p);
  if (err != cudaSuccess) {
    signals::finish(p.gather_ch, out, s, /*aborted=*/true);  // best effort
    return err;
  }
  return signals::finish(p.gather_ch, out, s);
}

}  // namespace pk::tp_matmul
