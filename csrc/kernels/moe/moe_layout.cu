// MoE layout on one device (pk_jax.moe_dispatch on an expert axis of one
// GPU): expert_ids -> each slot's row, each row's slot, the experts' group
// sizes and the dropped / invalid tallies, in one launch of one thread block
// (kernels/moe/moe.h states the result; pk_jax/ops/moe/primitive.py's XLA
// reference computes the same bit for bit, and runs beyond the bounds).
//
// Each of the block's 32 warps owns a contiguous segment of the slots, so
// slot order is (warp, then position in its segment):
//   1. every warp walks its segment 32 slots a step: __match_any_sync on the
//      key gives a lane its rank among the step's earlier lanes of its key
//      and the step's count of each key, added to the warp's running count
//      of that key (its row of a shared [warp][key] table); the slot's key
//      and its rank inside the segment are stashed in dest_row;
//   2. per key, an exclusive scan over the 32 warps turns the table into
//      each warp's base (earlier segments' slots of that key), the last
//      warp's total being the key's count;
//   3. one warp: kept = counts capped at the capacity, expert_base = their
//      exclusive scan, group_sizes, the tallies;
//   4. every warp walks its segment again: q = base + stashed rank, dest_row
//      and src_slot written; src_slot's rows past sum(kept) (padding) -1.
// The kept rows of expert e are expert_base[e] + [0, kept[e]), so the kept
// slots cover rows [0, sum(kept)) exactly once: step 4's two writes of
// src_slot never meet.
#include <cstdint>

#include "kernels/moe/moe.h"
#include "pk/cuda_check.h"

namespace pk::moe {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kKeys = kLayoutMaxExperts + 1;  // experts, then the invalid key
constexpr int kStride = kKeys + 1;            // odd: a key's 32 warp rows in 32 banks
constexpr int kKeysPerLane = (kKeys + 31) / 32;
constexpr int kBatch = 8;                     // steps whose loads are in flight together
constexpr int kRankBits = 16;                 // a rank inside a segment (< kMaxSlots / kWarps)
static_assert(kLayoutMaxSlots / kWarps <= (uint64_t(1) << kRankBits), "ranks overflow the stash");
static_assert(kKeys <= 32 * kKeysPerLane, "keys per lane");

// ---- arguments -------------------------------------------------------------
template <typename Id>
struct LayoutArgs {
  const Id* __restrict__ ids;          // [slots]
  int32_t* __restrict__ dest_row;      // [slots]; the stash between the passes
  int32_t* __restrict__ src_slot;      // [rows]
  int32_t* __restrict__ group_sizes;   // [experts]
  int32_t* __restrict__ num_dropped;
  int32_t* __restrict__ num_invalid;
  uint32_t slots;
  uint32_t rows;
  uint32_t segment;                    // slots of a warp, a multiple of 32
  int32_t experts;
  int32_t capacity;                    // < 0: none
};

struct Shared {
  int32_t warp_keys[kWarps * kStride];  // [warp][key]: running counts, then bases
  int32_t counts[kKeys];
  int32_t kept[kKeys];
  int32_t base[kKeys];                  // exclusive scan of kept
  int32_t total;                        // sum of kept: the rows in use
};

// ---- roles -----------------------------------------------------------------
template <typename Id>
__device__ __forceinline__ int32_t key_of(Id id, int32_t experts) {
  return id >= 0 && id < Id(experts) ? int32_t(id) : experts;
}

// Inclusive scan of x over the lanes of a full warp.
__device__ __forceinline__ int32_t warp_scan(int32_t x, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// Step 1 for one warp: its slots' ranks inside its segment, stashed in
// dest_row as key << kRankBits | rank; its row of the table ends with each
// key's count in the segment.
template <typename Id>
__device__ __forceinline__ void rank_in_segment(const LayoutArgs<Id>& a, int32_t* run,
                                                uint32_t begin, uint32_t end, int lane) {
  for (int32_t k = lane; k <= a.experts; k += 32) run[k] = 0;
  __syncwarp();
  const uint32_t below = (1u << lane) - 1u;
  for (uint32_t i0 = begin; i0 < end; i0 += 32 * kBatch) {
    int32_t key[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const uint32_t i = i0 + uint32_t(u) * 32 + lane;
      key[u] = i < end ? key_of(a.ids[i], a.experts) : -1;  // -1: no slot
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (i0 + uint32_t(u) * 32 >= end) break;                // warp-uniform
      const uint32_t peers = __match_any_sync(0xffffffffu, uint32_t(key[u]));
      const int32_t before = key[u] >= 0 ? run[key[u]] : 0;
      const int32_t rank = __popc(peers & below);
      __syncwarp();
      if (key[u] >= 0 && rank == 0) run[key[u]] = before + __popc(peers);
      __syncwarp();
      if (key[u] >= 0)
        a.dest_row[i0 + uint32_t(u) * 32 + lane] = key[u] << kRankBits | (before + rank);
    }
  }
}

// Step 2: per key, each warp's count -> the count of the earlier warps (a
// warp a key); the last warp's inclusive sum is the key's count.
__device__ __forceinline__ void scan_warps(Shared& sh, int32_t experts, int warp, int lane) {
  for (int32_t k = warp; k <= experts; k += kWarps) {
    int32_t* cell = &sh.warp_keys[lane * kStride + k];
    const int32_t x = *cell;
    const int32_t inclusive = warp_scan(x, lane);
    *cell = inclusive - x;
    if (lane == 31) sh.counts[k] = inclusive;
  }
}

// Step 3 (one warp): kept, its exclusive scan, group_sizes, the tallies.
template <typename Id>
__device__ __forceinline__ void size_groups(const LayoutArgs<Id>& a, Shared& sh, int lane) {
  int32_t kept[kKeysPerLane];
  int32_t sum = 0, dropped = 0;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    const int32_t e = lane * kKeysPerLane + j;
    const int32_t count = e < a.experts ? sh.counts[e] : 0;
    kept[j] = a.capacity >= 0 && count > a.capacity ? a.capacity : count;
    sum += kept[j];
    dropped += count - kept[j];
  }
  int32_t base = warp_scan(sum, lane) - sum;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    const int32_t e = lane * kKeysPerLane + j;
    if (e < a.experts) {
      sh.kept[e] = kept[j];
      sh.base[e] = base;
      a.group_sizes[e] = kept[j];
    }
    base += kept[j];
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) dropped += __shfl_xor_sync(0xffffffffu, dropped, d);
  if (lane == 31) sh.total = base;  // the last lane's end: sum(kept)
  if (lane == 0) {
    *a.num_dropped = dropped;
    *a.num_invalid = sh.counts[a.experts];
  }
}

// Step 4 for one warp: dest_row from the stash and the warp's bases, and
// src_slot of every kept slot's row.
template <typename Id>
__device__ __forceinline__ void place_segment(const LayoutArgs<Id>& a, const Shared& sh,
                                              const int32_t* warp_base, uint32_t begin,
                                              uint32_t end, int lane) {
  for (uint32_t i0 = begin; i0 < end; i0 += 32 * kBatch) {
    int32_t stash[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const uint32_t i = i0 + uint32_t(u) * 32 + lane;
      stash[u] = i < end ? a.dest_row[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (stash[u] < 0) continue;
      const uint32_t i = i0 + uint32_t(u) * 32 + lane;
      const int32_t key = stash[u] >> kRankBits;
      const int32_t q = (stash[u] & ((1 << kRankBits) - 1)) + warp_base[key];
      const bool keep = key < a.experts && q < sh.kept[key];
      const int32_t row = keep ? sh.base[key] + q : -1;
      a.dest_row[i] = row;
      if (keep) a.src_slot[row] = int32_t(i);
    }
  }
}

// ---- entry point -----------------------------------------------------------
template <typename Id>
__global__ void __launch_bounds__(kThreads)
    layout_kernel(const __grid_constant__ LayoutArgs<Id> a) {
  __shared__ Shared sh;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const uint64_t first = uint64_t(warp) * a.segment;
  const uint32_t begin = uint32_t(first < a.slots ? first : a.slots);
  const uint32_t end = uint32_t(first + a.segment < a.slots ? first + a.segment : a.slots);
  int32_t* run = &sh.warp_keys[warp * kStride];
  rank_in_segment(a, run, begin, end, lane);
  __syncthreads();
  scan_warps(sh, a.experts, warp, lane);
  __syncthreads();
  if (warp == 0) size_groups(a, sh, lane);
  __syncthreads();
  place_segment(a, sh, run, begin, end, lane);
  for (uint32_t p = uint32_t(sh.total) + threadIdx.x; p < a.rows; p += kThreads)
    a.src_slot[p] = -1;
}

template <typename Id>
cudaError_t launch(const LayoutParams& p) {
  const uint32_t per_warp = uint32_t((p.slots + kWarps - 1) / kWarps);
  const LayoutArgs<Id> a{static_cast<const Id*>(p.expert_ids), p.dest_row, p.src_slot,
                         p.group_sizes, p.num_dropped, p.num_invalid, uint32_t(p.slots),
                         uint32_t(p.rows), (per_warp + 31) / 32 * 32, p.experts,
                         // a capacity at or above the slots keeps them all
                         p.capacity < 0 || uint64_t(p.capacity) >= p.slots ? -1
                                                                           : int32_t(p.capacity)};
  layout_kernel<Id><<<1, kThreads, 0, p.stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run(const LayoutParams& p) {
  if (p.slots > kLayoutMaxSlots || p.rows > kLayoutMaxRows || p.experts < 1 ||
      p.experts > kLayoutMaxExperts)
    return cudaErrorInvalidValue;
  return p.ids64 ? launch<int64_t>(p) : launch<int32_t>(p);
}

cudaError_t load_layout_kernels() {
  PK_CUDA_TRY(preload_kernel(reinterpret_cast<const void*>(layout_kernel<int32_t>)));
  return preload_kernel(reinterpret_cast<const void*>(layout_kernel<int64_t>));
}

}  // namespace pk::moe
