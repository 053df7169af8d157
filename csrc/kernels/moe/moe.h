// MoE token exchange (pk_jax.moe_dispatch / moe_combine): host-side launch
// interface.
//
// One call moves rows of `row_bytes` bytes between the ranks of a group:
// source row i goes to rank peer[i], row index[i] of that rank's output
// (skipped when peer[i] < 0 or index[i] is outside [0, dst_rows)). Both
// arrays live on the device (computed there from the routing), so no host
// ever sees a size. Dispatch sends token slots to expert rows; combine sends
// expert rows back to their slots: the same call with the roles swapped.
// Output row p is the row that landed there when valid[p] >= 0, else zeros.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::moe {

struct Params {
  const void* src = nullptr;     // [src_rows, row_bytes] this rank's rows (XLA buffer)
  const int32_t* peer = nullptr;   // [src_rows] destination rank of each row, -1: none
  const int32_t* index = nullptr;  // [src_rows] its row at the destination
  const int32_t* valid = nullptr;  // [dst_rows] >= 0 where a row lands in the output
  void* dst = nullptr;           // [dst_rows, row_bytes] this rank's output (XLA buffer)
  uint64_t src_rows = 0;
  uint64_t dst_rows = 0;         // the same on every rank (static shapes)
  uint64_t row_bytes = 0;
  Channel ch{};                  // the channel's flags on every rank; rank, n
  char* region[kMaxRanks] = {};  // every rank's staging region (dst_rows rows)
  bool skip_post = false;        // testing: this rank never posts (timeout path)
  uint8_t poison = 0xFF;         // every byte of a failed call's output
  cudaStream_t stream = nullptr;
};

// Bytes of staging region each rank needs: one output's worth.
inline size_t staging_bytes(uint64_t dst_rows, uint64_t row_bytes) {
  return size_t(dst_rows) * size_t(row_bytes);
}

// Credit wait, the ld/st scatter of rows into the peers' regions, posts,
// bounded waits for every peer's post, the drain of our region into the
// output, finish (done flags, poison on failure, epoch).
cudaError_t launch_exchange(const Params& p);

// Load the exchange kernels on the current device (no lazy load while a peer spins).
cudaError_t load_kernels();

}  // namespace pk::moe
