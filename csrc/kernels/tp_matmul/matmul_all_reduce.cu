// matmul_all_reduce (see tp_matmul.h): out = psum(x @ w), the same bits on
// every rank. Two host sequences, by p.mechanism (AllReduceMechanism).
//
// chunked (kChunked), for call epoch e on rank r, m = M / n rows per chunk; chunk q is
// reduced by rank q alone, in one fixed order:
//   main stream:
//     credit (ch): every peer finished summing what we wrote into its region.
//     remote: for each peer q, nearest first: GEMM x[q's rows] @ w with its
//             output in slot r of q's ch region (the epilogue's stores cross
//             NVLink), then post q.
//     credit (gather_ch): every peer finished copying out our last chunk.
//     local:  n = 2: wait the peer; our chunk in P row pieces (one with
//             block factors), each a GEMM x[piece] @ w + the peer's partial
//             (the epilogue's C, fp32) -> out. n > 2: GEMM -> slot r of our
//             ch region, then one launch that waits for every peer and sums
//             the n slots in rank order (fp32) -> out; one piece.
//             After each piece the side stream forks off (below).
//     finish ch: done[r] = e to every peer; out poisoned if the call failed.
//     gather: for each peer q, in the order their pushes reach us: wait
//             posted[q] >= e on gather_ch, copy slot q of our gather region
//             -> q's rows of out.
//   side stream: each piece of our reduced chunk, as soon as it is written,
//     by the copy engine into slot r of every peer's gather region (1-D
//     copies: the rows are contiguous), overlapped with the next piece's
//     GEMM; then post every peer (post_checked: poison instead of numbers
//     if one of our waits gave up).
//   end: join the side stream, finish gather_ch (outputs poisoned if
//     anything failed).
// one_shot (kOneShot; decode-sized M; ch only, region: n slots of [M, N]): GEMM x @ w
//   -> slot r of our region; credit; for each peer q: copy engine slot r ->
//   slot r of q's region, post q; one launch waits for every peer and sums
//   the n slots in rank order (fp32) -> out; finish.
// With one rank: the GEMM into out, then finish. Every GEMM of the call is
// checked before anything is enqueued; a CUDA error from an enqueue still
// joins the side stream and finishes every channel the call uses, as
// aborted, so the epochs stay in step with the peers.
#include <algorithm>

#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::tp_matmul {
namespace {

bool is_one_shot(const Params& p) { return p.mechanism == AllReduceMechanism::kOneShot; }

// ---- launch config ---------------------------------------------------------
// Pieces of our reduced chunk (n = 2): each at least kMinPieceRows rows, so
// that its GEMM still fills the GPU; at most kMaxPieces. The last piece's
// push is what stays exposed. Provisional (not yet measured). With block
// factors one piece: a GEMM reads its rows' factors contiguous, and a
// piece's are a slice of each row of the chunk's [ceil(k / 128), m].
constexpr int64_t kMinPieceRows = 1024;
constexpr int64_t kMaxPieces = 4;

int64_t pieces(const Params& p) {
  if (is_one_shot(p) || p.n != 2 || block_scaled(p)) return 1;
  return std::clamp<int64_t>(p.m / kMinPieceRows, 1, kMaxPieces);
}

// ---- layout ----------------------------------------------------------------
size_t row_bytes(const Params& p) { return size_t(p.n_cols) * gemm::itemsize(p.out_type); }
size_t slot_bytes(const Params& p) { return size_t(p.m) * row_bytes(p); }

char* slot(char* region, const Params& p, int q) { return region + size_t(q) * slot_bytes(p); }

// Rows of the output: chunk q (chunked), or all of it (one_shot).
char* out_rows(const Params& p, int q) {
  return static_cast<char*>(p.out) + (is_one_shot(p) ? 0 : size_t(q) * slot_bytes(p));
}

size_t out_bytes(const Params& p) { return is_one_shot(p) ? slot_bytes(p) : p.n * slot_bytes(p); }

// Piece j of a chunk: its first row and row count.
void piece(const Params& p, int64_t j, int64_t* first, int64_t* rows) {
  const int64_t count = pieces(p);
  const int64_t per = (p.m + count - 1) / count;
  *first = j * per;
  *rows = std::min(per, p.m - *first);
}

// Every GEMM of the call, in order; `i` walks them, false after the last.
//   one rank: all rows -> out. one_shot: all rows -> slot r of our region.
//   chunked: q's rows into q's region for the peers nearest first, then our
//   chunk: n = 2 its pieces (+ the peer's partial) -> out; n > 2 -> our slot.
bool problem(const Params& p, int i, gemm::Problem* g) {
  if (p.n == 1 || is_one_shot(p)) {
    if (i > 0) return false;
    *g = x_rows_gemm(p, 0, p.m, p.n == 1 ? p.out : slot(p.region[p.rank], p, p.rank));
    return true;
  }
  if (i < p.n - 1) {
    const int q = (p.rank + 1 + i) % p.n;
    *g = x_rows_gemm(p, q * p.m, p.m, slot(p.region[q], p, p.rank));
    return true;
  }
  const int64_t j = i - (p.n - 1);  // piece of our chunk
  if (j >= pieces(p)) return false;
  if (p.n > 2) {
    *g = x_rows_gemm(p, p.rank * p.m, p.m, slot(p.region[p.rank], p, p.rank));
    return true;
  }
  int64_t first, rows;
  piece(p, j, &first, &rows);
  const size_t at = size_t(first) * row_bytes(p);
  *g = x_rows_gemm(p, p.rank * p.m + first, rows, out_rows(p, p.rank) + at,
                   slot(p.region[p.rank], p, 1 - p.rank) + at);
  return true;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
}

// Sums the n slots of our region into `dst` (fp32, rank order), after every
// peer posted on ch (the wait in the same launch).
cudaError_t wait_and_sum(const Params& p, void* dst, cudaStream_t s) {
  Params chunk = p;
  chunk.out = dst;
  return launch_sum_slots(chunk, p.region[p.rank], s, /*wait_posted=*/true);
}

// ---- roles -----------------------------------------------------------------
cudaError_t one_shot(const Params& p) {
  cudaStream_t s = p.stream;
  gemm::Problem g;
  problem(p, 0, &g);
  PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
  // Only our own slot so far: the credit wait overlaps the GEMM's tail.
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    PK_CUDA_TRY(copy(slot(p.region[q], p, p.rank), g.d, slot_bytes(p), s));
    PK_CUDA_TRY(signals::post(p.ch, q, out_rows_layout(p), p.skip_post, s));
  }
  return wait_and_sum(p, p.out, s);
}

// Side stream: rows [first, first + rows) of our reduced chunk, once the
// main stream wrote them, into slot r of every peer's gather region.
cudaError_t push_piece(const Params& p, int64_t first, int64_t rows, bool* forked) {
  PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
  *forked = true;
  const size_t at = size_t(first) * row_bytes(p);
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    PK_CUDA_TRY(copy(slot(p.gather_region[q], p, p.rank) + at, out_rows(p, p.rank) + at,
                     size_t(rows) * row_bytes(p), p.side_stream));
  }
  return cudaSuccess;
}

// Everything of the chunked sequence up to the join. *forked once the side
// stream waits on ours; *reduced once ch's finish is enqueued.
cudaError_t chunked(const Params& p, const signals::Outputs& out, bool* forked,
                    bool* reduced) {
  cudaStream_t s = p.stream;
  gemm::Problem g;
  PK_CUDA_TRY(signals::wait_credit(p.ch, s));
  for (int k = 1; k < p.n; ++k) {
    problem(p, k - 1, &g);
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    PK_CUDA_TRY(signals::post(p.ch, (p.rank + k) % p.n, out_rows_layout(p), p.skip_post, s));
  }
  PK_CUDA_TRY(signals::wait_credit(p.gather_ch, s));
  if (p.n == 2) {
    PK_CUDA_TRY(signals::wait_posted(p.ch, 1 - p.rank, out_rows_layout(p), s));
  } else {
    problem(p, p.n - 1, &g);
    PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    PK_CUDA_TRY(wait_and_sum(p, out_rows(p, p.rank), s));
  }
  for (int64_t j = 0; j < pieces(p); ++j) {
    int64_t first, rows;
    piece(p, j, &first, &rows);
    if (p.n == 2) {
      problem(p, int(p.n - 1 + j), &g);
      PK_CUDA_TRY(gemm::run(g, p.gemm_dev, s));
    }
    PK_CUDA_TRY(push_piece(p, first, rows, forked));
  }
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + k) % p.n;
    const signals::Outputs staged(slot(p.gather_region[q], p, p.rank), slot_bytes(p));
    PK_CUDA_TRY(signals::post_checked(p.gather_ch, q, out_rows_layout(p), staged, p.skip_post,
                                      p.side_stream));
  }
  PK_CUDA_TRY(signals::finish(p.ch, out, s));
  *reduced = true;
  for (int k = 1; k < p.n; ++k) {
    const int q = (p.rank + p.n - k) % p.n;  // q pushes to us at its k-th step
    PK_CUDA_TRY(signals::wait_posted(p.gather_ch, q, out_rows_layout(p), s));
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
  if (p.n == 1 || is_one_shot(p)) {
    problem(p, 0, &g);
    return signals::finish_after(p.n == 1 ? gemm::run(g, p.gemm_dev, s) : one_shot(p), p.ch,
                                 out, s);
  }
  bool forked = false, reduced = false;
  cudaError_t err = chunked(p, out, &forked, &reduced);
  if (forked) err = signals::join(err, p.join, p.side_stream, s);
  if (err != cudaSuccess) {  // best effort: every channel's call ends, as aborted
    if (!reduced) signals::finish(p.ch, out, s, /*aborted=*/true);
    signals::finish(p.gather_ch, out, s, /*aborted=*/true);
    return err;
  }
  return signals::finish(p.gather_ch, out, s);
}

}  // namespace pk::tp_matmul
