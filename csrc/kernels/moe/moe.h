// MoE token exchange (pk_jax.moe_dispatch / moe_combine) and the one-device
// kernels of the layout's rows: host-side interface, one run() overload per
// job (its params type): the exchange (Params), scatter_rows
// (ScatterParams), weighted_sum (SumParams), layout (LayoutParams).
//
// The routing, on the device (no host ever sees a size), in slot terms:
// slot i (token i / repeat's copy i % repeat, where tokens are repeated) has
// a row on rank slot_peer[i], row slot_row[i] of that rank's rows (none when
// slot_peer[i] < 0 or slot_row[i] is outside [0, rows)); on the rows' side,
// row p of this rank came from rank row_src[p] (-1: padding). Both sides are
// consistent by construction (one layout computed from the gathered counts).
//
//   kToRows (dispatch; combine's transpose): src [slots / repeat] tokens ->
//     dst [rows]: every slot pushes its token's row to its row's rank; rows
//     whose source is this rank are stored straight into dst, the others
//     land in the receiver's staging region and are drained from there;
//     padding rows are zeros.
//   kToSlots (combine; dispatch's transpose, repeat 1): src [rows] -> dst
//     [slots]: every rank stages the rows it owes other ranks in its own
//     region, then every slot pulls its row (from src when it is local),
//     zeros for slots without a row.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::moe {

enum class Direction : int32_t { kToRows = 0, kToSlots = 1 };

struct Params {
  Direction dir = Direction::kToRows;
  const void* src = nullptr;          // kToRows: [slots / repeat], kToSlots: [rows] (XLA buffer)
  void* dst = nullptr;                // kToRows: [rows], kToSlots: [slots] (XLA buffer)
  const int32_t* slot_peer = nullptr; // [slots] rank of each slot's row, -1: none
  const int32_t* slot_row = nullptr;  // [slots] its row there
  const int32_t* row_src = nullptr;   // [rows] source rank of each row, -1: padding
  uint64_t slots = 0;
  uint64_t rows = 0;                  // the same on every rank (static shapes)
  uint64_t repeat = 1;                // kToRows: slots per source row
  uint64_t row_bytes = 0;
  Channel ch{};                       // the channel's flags on every rank; rank, n
  char* region[kMaxRanks] = {};       // every rank's staging region (rows rows)
  bool skip_post = false;             // testing: this rank never posts (timeout path)
  uint8_t poison = 0xFF;              // every byte of a failed call's output
  cudaStream_t stream = nullptr;
};

// Bytes of staging region each rank needs: `rows` rows, either direction.
inline size_t staging_bytes(uint64_t rows, uint64_t row_bytes) {
  return size_t(rows) * size_t(row_bytes);
}

// The exchange (moe_exchange.cu), on p.stream: credit wait, the copies into
// staging (kToRows: the peers' regions; kToSlots: our own), posts, bounded
// waits for every peer's post, the copies out of staging into dst, finish
// (done flags, poison on failure, epoch).
cudaError_t run(const Params& p);

// ---- one device (moe_local.cu): the layout's rows moved on this GPU alone ----
// scatter_rows: out [rows] row dest[i] = scale[i] * src row i / repeat for
// every slot i (scale null: 1; dest out of [0, rows): none), each src row
// read once; zeros on the rows whose row_slot is out of [0, src_rows *
// repeat). dest and row_slot are each other's inverse (the layout makes
// them so). Dispatch (repeat k) and combine's input gradient (each slot's
// router weight as scale).
struct ScatterParams {
  DType type = DType::kBF16;          // of src and out (bf16, f16 or f32)
  const void* src = nullptr;          // [src_rows, cols]
  void* out = nullptr;                // [rows, cols]
  const int32_t* dest = nullptr;      // [src_rows * repeat] the row of each slot, < 0: none
  const int32_t* row_slot = nullptr;  // [rows] the slot of each row, < 0: none
  const float* scale = nullptr;       // [src_rows * repeat] per slot, or null
  uint64_t src_rows = 0;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t repeat = 1;
  cudaStream_t stream = nullptr;
};

// weighted_sum: out [tokens] row t = sum over j < k of weight[t * k + j] *
// src row index[t * k + j] (weight null: 1), accumulated in fp32 in j order,
// rows outside [0, src_rows) skipped. Combine (index: each slot's row) and
// dispatch's input gradient (no weights).
struct SumParams {
  DType type = DType::kBF16;          // of src and out
  const void* src = nullptr;          // [src_rows, cols]
  void* out = nullptr;                // [tokens, cols]
  const int32_t* index = nullptr;     // [tokens * k] the row of each slot, < 0: none
  const float* weight = nullptr;      // [tokens * k], or null
  uint64_t src_rows = 0;
  uint64_t tokens = 0;
  uint64_t k = 1;
  uint64_t cols = 0;
  cudaStream_t stream = nullptr;
};

// layout (moe_layout.cu): the one-device layout of expert_ids [slots] (slot
// i = token * k + choice), one thread block. A slot is valid when 0 <= id <
// experts; its key is its id, or `experts` when invalid (invalid last); q[i]
// = the earlier slots (slot order) of its key. kept[e] = counts[e], capped
// at capacity (>= 0; < 0: none); group_sizes = kept; dest_row[i] =
// exclusive_cumsum(kept)[key] + q[i] for a valid slot with q[i] < kept[key],
// else -1; src_slot[p] = the slot whose dest_row is p, -1 on the rows past
// sum(kept); num_dropped = valid slots without a row, num_invalid = invalid
// slots. The kernel's bounds (pk_jax/ops/moe/primitive.py: beyond them the
// layout runs as XLA ops): slots <= kLayoutMaxSlots, experts in [1,
// kLayoutMaxExperts], rows <= kLayoutMaxRows.
constexpr uint64_t kLayoutMaxSlots = uint64_t(1) << 16;
constexpr int32_t kLayoutMaxExperts = 255;
constexpr uint64_t kLayoutMaxRows = uint64_t(1) << 18;

struct LayoutParams {
  const void* expert_ids = nullptr;   // [slots] int32, or int64 when ids64
  bool ids64 = false;
  int32_t* dest_row = nullptr;        // [slots]
  int32_t* src_slot = nullptr;        // [rows]
  int32_t* group_sizes = nullptr;     // [experts]
  int32_t* num_dropped = nullptr;     // []
  int32_t* num_invalid = nullptr;     // []
  uint64_t slots = 0;
  uint64_t rows = 0;
  int32_t experts = 1;
  int64_t capacity = -1;              // rows each expert keeps, < 0: all
  cudaStream_t stream = nullptr;
};

// The one-device kernels, on p.stream: scatter_rows and weighted_sum
// (moe_local.cu), layout (moe_layout.cu; cudaErrorInvalidValue beyond the
// bounds).
cudaError_t run(const ScatterParams& p);
cudaError_t run(const SumParams& p);
cudaError_t run(const LayoutParams& p);

// Load the exchange kernels on the current device (no lazy load while a peer
// spins), and the one-device kernels.
cudaError_t load_kernels();
cudaError_t load_local_kernels();
cudaError_t load_layout_kernels();

}  // namespace pk::moe
