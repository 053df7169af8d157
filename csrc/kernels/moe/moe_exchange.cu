// MoE token exchange, ld/st staged mechanism: SM kernels read each slot's
// row (rank, row) and each row's source rank from device arrays; rows that
// stay on this rank never touch staging; stream signals (pk/signals.h)
// carry the protocol.
//
// Protocol for call epoch e on rank r, all on r's stream, in the channel's
// own data region (`rows` rows on every rank):
//   credit:  wait until every peer q has done[q] >= e-1 (every rank finished
//            reading the staging regions of the last call).
//   stage:   kToRows: slot i's token row -> region[slot_peer[i]] row
//            slot_row[i] over NVLink, or straight into dst when the row is
//            r's own. kToSlots: row p -> region[r] row p for the rows owed
//            to other ranks (row_src[p] not r, not padding).
//   post:    posted[r] = e on every peer (release, after a system fence),
//            then wait (bounded) for posted[q] >= e from every peer.
//   collect: kToRows: dst row p = region[r] row p for rows of other
//            sources, zeros for padding (r's own rows are already there).
//            kToSlots: dst row i = region[slot_peer[i]] row slot_row[i]
//            (src's row when the rank is r), zeros for slots without a row.
//   finish:  done[r] = e on every peer, the output poisoned if the call
//            failed (signals::finish), epoch = e.
// A failed wait cannot stop the kernels after it; signals.h says what keeps
// that safe (only pk's staging memory can be overwritten late, and the call
// that read it is caught and poisoned).
#include <algorithm>
#include <array>

#include "kernels/moe/moe.h"
#include "pk/copy.cuh"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::moe {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 1024;  // rows are grid-strided beyond this

// ---- arguments -------------------------------------------------------------
// Both kernels of a direction take the same arguments.
struct Args {
  const char* src;
  char* dst;
  const int32_t* slot_peer;
  const int32_t* slot_row;
  const int32_t* row_src;
  uint64_t slots;
  uint64_t rows;
  uint64_t repeat;
  uint64_t row_bytes;
  int n;
  int rank;
  char* region[kMaxRanks];

  // Slot i's row rank, or -1 when it has none (or an index out of range:
  // the layout never makes one, and it must not write outside a region).
  __device__ __forceinline__ int slot_rank(uint64_t i) const {
    const int q = slot_peer[i];
    const int64_t row = slot_row[i];
    return q >= 0 && q < n && row >= 0 && uint64_t(row) < rows ? q : -1;
  }
  __device__ __forceinline__ char* row_of(char* base, uint64_t row) const {
    return base + row * row_bytes;
  }
};

// ---- roles -----------------------------------------------------------------
// One row, vectors of V, by the threads of a block.
template <typename V>
__device__ __forceinline__ void copy_row(const char* from, char* to, uint64_t row_bytes) {
  const V* s = reinterpret_cast<const V*>(from);
  V* d = reinterpret_cast<V*>(to);
  for (uint64_t k = threadIdx.x; k < row_bytes / sizeof(V); k += blockDim.x) d[k] = __ldcg(s + k);
}

template <typename V>
__device__ __forceinline__ void zero_row(char* to, uint64_t row_bytes) {
  V* d = reinterpret_cast<V*>(to);
  for (uint64_t k = threadIdx.x; k < row_bytes / sizeof(V); k += blockDim.x) d[k] = V{};
}

// ---- entry points ----------------------------------------------------------
// kToRows, stage: slot i's token row to its row's rank (dst when local).
template <typename V>
__global__ void __launch_bounds__(kThreads) push_kernel(const __grid_constant__ Args a) {
  for (uint64_t i = blockIdx.x; i < a.slots; i += gridDim.x) {
    const int q = a.slot_rank(i);
    if (q < 0) continue;
    char* base = q == a.rank ? a.dst : a.region[q];
    copy_row<V>(a.src + (i / a.repeat) * a.row_bytes, a.row_of(base, a.slot_row[i]),
                a.row_bytes);
  }
}

// kToRows, collect: rows of other sources out of our region, padding zeroed.
template <typename V>
__global__ void __launch_bounds__(kThreads) drain_kernel(const __grid_constant__ Args a) {
  for (uint64_t p = blockIdx.x; p < a.rows; p += gridDim.x) {
    const int s = a.row_src[p];
    if (s == a.rank) continue;  // stored by our push
    if (s >= 0 && s < a.n)
      copy_row<V>(a.row_of(a.region[a.rank], p), a.row_of(a.dst, p), a.row_bytes);
    else
      zero_row<V>(a.row_of(a.dst, p), a.row_bytes);
  }
}

// kToSlots, stage: the rows owed to other ranks into our own region.
template <typename V>
__global__ void __launch_bounds__(kThreads) stage_kernel(const __grid_constant__ Args a) {
  for (uint64_t p = blockIdx.x; p < a.rows; p += gridDim.x) {
    const int s = a.row_src[p];
    if (s >= 0 && s < a.n && s != a.rank)
      copy_row<V>(a.src + p * a.row_bytes, a.row_of(a.region[a.rank], p), a.row_bytes);
  }
}

// kToSlots, collect: every slot pulls its row (local rows from src).
template <typename V>
__global__ void __launch_bounds__(kThreads) pull_kernel(const __grid_constant__ Args a) {
  for (uint64_t i = blockIdx.x; i < a.slots; i += gridDim.x) {
    char* out = a.row_of(a.dst, i);
    const int q = a.slot_rank(i);
    if (q < 0) {
      zero_row<V>(out, a.row_bytes);
      continue;
    }
    const char* base = q == a.rank ? a.src : a.region[q];
    copy_row<V>(base + uint64_t(a.slot_row[i]) * a.row_bytes, out, a.row_bytes);
  }
}

// Widest access that divides every offset the kernels form.
int access_width(const Params& p) {
  uint64_t bits = p.row_bytes | reinterpret_cast<uintptr_t>(p.src) |
                  reinterpret_cast<uintptr_t>(p.dst);
  for (int q = 0; q < p.ch.n; ++q) bits |= reinterpret_cast<uintptr_t>(p.region[q]);
  return pk::access_width(bits);
}

int grid(uint64_t rows) { return int(std::clamp<uint64_t>(rows, 1, kMaxBlocks)); }

template <typename V>
cudaError_t enqueue_typed(const Params& p) {
  const Channel& ch = p.ch;
  cudaStream_t s = p.stream;
  Args a{};
  a.src = static_cast<const char*>(p.src);
  a.dst = static_cast<char*>(p.dst);
  a.slot_peer = p.slot_peer;
  a.slot_row = p.slot_row;
  a.row_src = p.row_src;
  a.slots = p.slots;
  a.rows = p.rows;
  a.repeat = p.repeat;
  a.row_bytes = p.row_bytes;
  a.n = ch.n;
  a.rank = ch.rank;
  for (int q = 0; q < ch.n; ++q) a.region[q] = p.region[q];
  const bool to_rows = p.dir == Direction::kToRows;
  // (stage kernel, its row count), (collect kernel, its row count)
  const auto stage = to_rows ? push_kernel<V> : stage_kernel<V>;
  const auto collect = to_rows ? drain_kernel<V> : pull_kernel<V>;
  const uint64_t stage_rows = to_rows ? p.slots : p.rows;
  const uint64_t collect_rows = to_rows ? p.rows : p.slots;

  PK_CUDA_TRY(signals::wait_credit(ch, s));
  if (stage_rows > 0) {
    stage<<<grid(stage_rows), kThreads, 0, s>>>(a);
    PK_CUDA_TRY(cudaGetLastError());
  }
  // the layout: the tokens, the row bytes and the direction (dispatch or combine)
  const signals::PostLayout layout{p.rows | (to_rows ? signals::PostLayout::kReturn : 0),
                                   p.row_bytes};
  PK_CUDA_TRY(signals::post(ch, signals::kAllPeers, layout, p.skip_post, s));
  PK_CUDA_TRY(signals::wait_posted(ch, signals::kAllPeers, layout, s));
  if (collect_rows > 0) {
    collect<<<grid(collect_rows), kThreads, 0, s>>>(a);
    PK_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

cudaError_t enqueue(const Params& p) {
  return with_access_width(access_width(p), [&](auto vec) {
    return enqueue_typed<typename decltype(vec)::type>(p);
  });
}

}  // namespace

cudaError_t run(const Params& p) {
  const uint64_t out_rows = p.dir == Direction::kToRows ? p.rows : p.slots;
  const signals::Outputs out(p.dst, out_rows * p.row_bytes, p.poison);
  return signals::finish_after(enqueue(p), p.ch, out, p.stream);
}

cudaError_t load_kernels() {
  return preload_per_width([](auto tag) {
    using V = typename decltype(tag)::type;
    return std::array{reinterpret_cast<const void*>(push_kernel<V>),
                      reinterpret_cast<const void*>(drain_kernel<V>),
                      reinterpret_cast<const void*>(stage_kernel<V>),
                      reinterpret_cast<const void*>(pull_kernel<V>)};
  });
}

}  // namespace pk::moe
