// all_gather, copy-engine mechanism: the copy engines move every byte; one-warp
// signal kernels (pk/signals.h) carry the protocol, so no SM moves data.
//
// Protocol for call epoch e on rank r, all on r's stream, in the channel's
// own data region:
//   credit: wait until every peer q has done[q] >= e-1, i.e. q finished
//           copying out what r pushed into q's region last call.
//   push:   CE copies r's input into slot r of every peer's region, and into
//           r's own output block.
//   post:   posted[r] = e on every peer (release), then wait for posted[q] >= e.
//   drain:  CE copies slot q of our region into our output block q.
//   finish: done[r] = e on every peer (our slots may be reused), the output
//           poisoned if the call failed (signals::finish), epoch = e.
// A failed wait cannot stop the copies after it (signals.h says what keeps
// that safe). A CUDA error from an enqueue still finishes the call, as
// aborted (best effort: the epoch stays in step with the peers, who time
// out, the error is recorded and the output poisoned).
#include "kernels/all_gather/all_gather.h"
#include "pk/copy_rows.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::all_gather {
namespace {

// Output block q: rows of row_bytes at dst + q * row_bytes, pitch n * row_bytes.
// A copy per row (pk/copy_rows.h), so gathers along a later axis (many short
// rows) are slow on this path; "auto" never picks it (pk_jax/tuning.py).
cudaError_t copy_block(const Params& p, int q, const void* src, cudaStream_t s) {
  char* out = static_cast<char*>(p.dst) + size_t(q) * p.row_bytes;
  return copy_rows(out, size_t(p.ch.n) * p.row_bytes, src, p.row_bytes, p.row_bytes, p.rows, s);
}

cudaError_t enqueue(const Params& p) {
  const Channel& ch = p.ch;
  const size_t block_bytes = p.rows * p.row_bytes;
  cudaStream_t s = p.stream;
  PK_CUDA_TRY(signals::wait_credit(ch, s));
  for (int k = 1; k < ch.n; ++k) {  // neighbours first, so links are spread
    const int q = (ch.rank + k) % ch.n;
    char* slot = p.region[q] + size_t(ch.rank) * block_bytes;
    PK_CUDA_TRY(cudaMemcpyAsync(slot, p.src, block_bytes, cudaMemcpyDeviceToDevice, s));
  }
  PK_CUDA_TRY(copy_block(p, ch.rank, p.src, s));
  const signals::PostLayout layout{p.rows, p.row_bytes};
  PK_CUDA_TRY(signals::post(ch, signals::kAllPeers, layout, p.skip_post, s));
  PK_CUDA_TRY(signals::wait_posted(ch, signals::kAllPeers, layout, s));
  for (int q = 0; q < ch.n; ++q) {
    if (q == ch.rank) continue;
    const char* received = p.region[ch.rank] + size_t(q) * block_bytes;
    PK_CUDA_TRY(copy_block(p, q, received, s));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t run_copy_engine(const Params& p) {
  const signals::Outputs out(p.dst, uint64_t(p.ch.n) * p.rows * p.row_bytes, p.poison);
  return signals::finish_after(enqueue(p), p.ch, out, p.stream);
}

}  // namespace pk::all_gather
