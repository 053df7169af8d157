// Device side of signals::PostLayout: the layout a staged post carries, in
// the consumer's SlotFlags::rows / row_bytes (indexed by the posting rank,
// single writer), and the wait that consumes the block and checks it.
#pragma once

#include "pk/channel.h"
#include "pk/signals.h"
#include "pk/sync.cuh"

namespace pk::signals {

// Before the release of posted[rank] on rank q (the release orders these).
__device__ __forceinline__ void publish_layout(const Channel& ch, int q,
                                               const PostLayout& layout) {
  store_relaxed_sys(&ch.flags[q]->rows[ch.rank], layout.rows);
  store_relaxed_sys(&ch.flags[q]->row_bytes[ch.rank], layout.row_bytes);
}

// After acquiring rank q's post of this call: kErrLayout (the call fails)
// when q staged another layout than `layout`. q's next call cannot rewrite
// the words before our `finish` releases its credit.
__device__ __forceinline__ void check_layout(const Channel& ch, int q, const PostLayout& layout) {
  const uint64_t rows = load_relaxed_sys(&ch.mine()->rows[q]);
  const uint64_t row_bytes = load_relaxed_sys(&ch.mine()->row_bytes[q]);
  if (rows != layout.rows || row_bytes != layout.row_bytes)
    record_error(ch.wait, kErrLayout, q, 0, layout.rows, rows, layout.row_bytes, row_bytes);
}

// Wait (bounded) for rank q's post of this call, then check its layout.
__device__ __forceinline__ void wait_posted_layout(const Channel& ch, int q,
                                                   const PostLayout& layout) {
  if (wait_geq(&ch.mine()->posted[q], ch.next_epoch(), ch.wait, q, kWaitPosted))
    check_layout(ch, q, layout);
}

}  // namespace pk::signals
