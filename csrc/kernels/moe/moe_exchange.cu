// MoE token exchange, ld/st staged mechanism: an SM kernel reads each row's
// destination (rank, row) from device arrays and stores the row into that
// rank's staging region; stream signals (pk/signals.h) carry the protocol.
//
// Protocol for call epoch e on rank r, all on r's stream, in the channel's
// own data region (dst_rows rows on every rank):
//   credit:  wait until every peer q has done[q] >= e-1 (q drained what r
//            stored into q's region last call).
//   scatter: row i -> region[peer[i]] + index[i] * row_bytes (NVLink stores
//            for peers, local stores for r itself).
//   post:    posted[r] = e on every peer (release, after a system fence),
//            then wait (bounded) for posted[q] >= e from every peer.
//   drain:   output row p = region[r] row p where valid[p] >= 0, else zeros.
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
struct ScatterArgs {
  const char* src;
  const int32_t* peer;
  const int32_t* index;
  uint64_t src_rows;
  uint64_t dst_rows;
  uint64_t row_bytes;
  int n;
  char* region[kMaxRanks];
};

struct DrainArgs {
  const char* region;  // ours
  const int32_t* valid;
  char* dst;
  uint64_t dst_rows;
  uint64_t row_bytes;
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
// Rows whose destination is out of range are skipped (the layout never
// produces them; a wrong index must not write outside a region).
template <typename V>
__global__ void __launch_bounds__(kThreads) scatter_kernel(const __grid_constant__ ScatterArgs a) {
  for (uint64_t i = blockIdx.x; i < a.src_rows; i += gridDim.x) {
    const int q = a.peer[i];
    const int64_t row = a.index[i];
    if (q < 0 || q >= a.n || row < 0 || uint64_t(row) >= a.dst_rows) continue;
    copy_row<V>(a.src + i * a.row_bytes, a.region[q] + uint64_t(row) * a.row_bytes, a.row_bytes);
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads) drain_kernel(const __grid_constant__ DrainArgs a) {
  for (uint64_t p = blockIdx.x; p < a.dst_rows; p += gridDim.x) {
    char* out = a.dst + p * a.row_bytes;
    if (a.valid[p] >= 0)
      copy_row<V>(a.region + p * a.row_bytes, out, a.row_bytes);
    else
      zero_row<V>(out, a.row_bytes);
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
  PK_CUDA_TRY(signals::wait_credit(ch, s));
  ScatterArgs sa{};
  sa.src = static_cast<const char*>(p.src);
  sa.peer = p.peer;
  sa.index = p.index;
  sa.src_rows = p.src_rows;
  sa.dst_rows = p.dst_rows;
  sa.row_bytes = p.row_bytes;
  sa.n = ch.n;
  for (int q = 0; q < ch.n; ++q) sa.region[q] = p.region[q];
  if (p.src_rows > 0) {
    scatter_kernel<V><<<grid(p.src_rows), kThreads, 0, s>>>(sa);
    PK_CUDA_TRY(cudaGetLastError());
  }
  PK_CUDA_TRY(signals::post(ch, signals::kAllPeers, p.skip_post, s));
  PK_CUDA_TRY(signals::wait_posted(ch, signals::kAllPeers, s));
  DrainArgs da{p.region[ch.rank], p.valid, static_cast<char*>(p.dst), p.dst_rows, p.row_bytes};
  if (p.dst_rows > 0) {
    drain_kernel<V><<<grid(p.dst_rows), kThreads, 0, s>>>(da);
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

cudaError_t launch_exchange(const Params& p) {
  const signals::Outputs out(p.dst, p.dst_rows * p.row_bytes, p.poison);
  if (cudaError_t err = enqueue(p); err != cudaSuccess) {
    signals::finish(p.ch, out, p.stream, /*aborted=*/true);  // best effort
    return err;
  }
  return signals::finish(p.ch, out, p.stream);
}

cudaError_t load_kernels() {
  return preload_per_width([](auto tag) {
    using V = typename decltype(tag)::type;
    return std::array{reinterpret_cast<const void*>(scatter_kernel<V>),
                      reinterpret_cast<const void*>(drain_kernel<V>)};
  });
}

}  // namespace pk::moe
