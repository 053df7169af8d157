// all_reduce, ld/st one-shot: one kernel per call, for small messages
// (latency: no stream signal kernels, no second launch).
//
// For call epoch e on rank r of n (the channel's region holds n slots of
// x's bytes rounded up to 16; slot q is what rank q sent):
//   1. credit: thread q of every block waits for done[q] >= e - 1 (peer q
//      finished reading the slot we write, last call). A wait that gives up
//      means the peer may still read it: this block then writes nothing
//      there, and nothing is posted (3), so the peer's own wait fails too.
//   2. push:   the grid stores x into slot r of every peer's region (16-byte
//      vectors where x allows), block b its share.
//   3. arrive: every block fences at system scope and counts itself on a
//      local counter; the last one resets it and, unless a wait on the
//      device failed, releases posted[r] = e on every peer.
//   4. reduce: thread q of every block waits for posted[q] >= e (acquire;
//      every spin is a local load) and checks the size q posted with it
//      (another size: kErrLayout, the result is poisoned), then the grid
//      sums the n blocks in rank order (sum.cuh) into the result: x itself
//      for q = r, slot q else.
//   5. finish: the last block to finish (the channel's ticket) releases
//      done[r] = e to every peer, poisons the result if the device holds an
//      error, and advances the epoch.
// All blocks must be resident at once (a block spins at 4 on posts that
// every block of every rank contributes to): the grid is at most one block
// per SM; the waits are bounded regardless.
#include <algorithm>

#include "kernels/all_reduce/all_reduce.h"
#include "kernels/all_reduce/sum.cuh"
#include "pk/cuda_check.h"
#include "pk/sync.cuh"

namespace pk::all_reduce {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 512;
constexpr uint64_t kBytesPerBlock = 16 << 10;  // small messages: few blocks, cheap arrivals

// ---- arguments -------------------------------------------------------------
struct OneShotArgs {
  ReduceArgs sum;          // sources: x for our rank, slot q of our region else
  const char* src;         // x
  char* slots[kMaxRanks];  // slot r of every rank's region (ours unused)
  uint64_t bytes;          // of x
  bool vec16;              // x and every slot 16-byte aligned
  Channel ch;
  bool skip_post;
  uint8_t poison;
};

// ---- roles -----------------------------------------------------------------
__device__ bool credit(const OneShotArgs& a, uint64_t epoch) {
  const int q = threadIdx.x;
  bool ok = true;
  if (q < a.ch.n && q != a.ch.rank)
    ok = wait_geq(&a.ch.mine()->done[q], epoch - 1, a.ch.wait, q, kWaitDone);
  return __syncthreads_and(ok);
}

__device__ void push(const OneShotArgs& a, bool ok) {
  if (!ok) return;  // a failed credit: write nothing (see 1.)
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t threads = uint64_t(gridDim.x) * blockDim.x;
  for (int k = 1; k < a.ch.n; ++k) {
    char* dst = a.slots[(a.ch.rank + k) % a.ch.n];
    uint64_t done = 0;
    if (a.vec16) {
      const uint64_t vecs = a.bytes / 16;
      const uint4* s = reinterpret_cast<const uint4*>(a.src);
      uint4* d = reinterpret_cast<uint4*>(dst);
      for (uint64_t i = tid; i < vecs; i += threads) d[i] = __ldcg(s + i);
      done = vecs * 16;
    }
    for (uint64_t i = done + tid; i < a.bytes; i += threads) dst[i] = a.src[i];
  }
}

// Counts this block on *counter; true in the last of the grid, which has
// then acquired every block's writes (and reset the counter for the next call).
__device__ bool last_block(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the block's stores (peer memory included) first
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence_system();
      *counter = 0;
    }
  }
  __syncthreads();
  return last;
}

// In the last block to arrive. A block that skipped its pushes (a failed
// credit wait) recorded the failure before it arrived, so the decision,
// taken once for every peer, sees it: a peer is posted only when every
// block wrote its slot.
__device__ void post(const OneShotArgs& a, uint64_t epoch) {
  __shared__ bool failed;
  if (threadIdx.x == 0) failed = device_failed(a.ch.wait);
  __syncthreads();
  const int q = threadIdx.x;
  if (failed || a.skip_post || q >= a.ch.n || q == a.ch.rank) return;
  // Our block's size with the post (the release orders it): a peer running
  // another program on this channel sees a size other than its own.
  store_relaxed_sys(&a.ch.flags[q]->row_bytes[a.ch.rank], a.bytes);
  store_release_sys(&a.ch.flags[q]->posted[a.ch.rank], epoch);
}

// A slot staged for another size (two programs sharing the channel ran in
// different orders) is an error (kErrLayout): the sum still reads only our
// own region, and finish poisons the result.
__device__ void wait_posted(const OneShotArgs& a, uint64_t epoch) {
  const int q = threadIdx.x;
  if (q < a.ch.n && q != a.ch.rank &&
      wait_geq(&a.ch.mine()->posted[q], epoch, a.ch.wait, q, kWaitPosted)) {
    const uint64_t theirs = load_relaxed_sys(&a.ch.mine()->row_bytes[q]);
    if (theirs != a.bytes) record_error(a.ch.wait, kErrLayout, q, 0, 1, 1, a.bytes, theirs);
  }
  __syncthreads();  // thread q's acquire orders the block's reads of slot q
}

__device__ void finish(const OneShotArgs& a, uint64_t epoch, size_t esize) {
  SlotFlags* mine = a.ch.mine();
  if (!last_block(&mine->ticket)) return;
  const int q = threadIdx.x;
  if (q < a.ch.n && q != a.ch.rank) store_release_sys(&a.ch.flags[q]->done[a.ch.rank], epoch);
  if (__syncthreads_or(threadIdx.x == 0 && device_failed(a.ch.wait)))
    poison_bytes(a.sum.dst, a.sum.len * esize, a.poison, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) mine->epoch = epoch;
}

// ---- entry point -----------------------------------------------------------
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kThreads) one_shot_kernel(const __grid_constant__ OneShotArgs a) {
  const uint64_t epoch = a.ch.next_epoch();
  push(a, credit(a, epoch));
  if (last_block(&a.ch.mine()->arrive[0][0])) post(a, epoch);
  wait_posted(a, epoch);
  sum_grid<T, kPacked>(a.sum);
  finish(a, epoch, sizeof(T));
}

template <typename T>
cudaError_t launch_typed(const OneShotArgs& a, int blocks, cudaStream_t s) {
  if (packable(a.sum, sizeof(T)))
    one_shot_kernel<T, true><<<blocks, kThreads, 0, s>>>(a);
  else
    one_shot_kernel<T, false><<<blocks, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

uint64_t one_shot_slot_bytes(uint64_t bytes) { return (bytes + 15) / 16 * 16; }

cudaError_t launch_one_shot(const Params& p) {
  const size_t es = elem_bytes(p.elem);
  const uint64_t elems = p.geo.rows * p.geo.stride;
  const uint64_t slot = one_shot_slot_bytes(elems * es);
  OneShotArgs a{};
  a.src = static_cast<const char*>(p.src);
  a.bytes = elems * es;
  const int r = p.ch.rank;
  for (int q = 0; q < p.ch.n; ++q) {
    a.slots[q] = p.region[q] + uint64_t(r) * slot;
    a.sum.src[q] = q == r ? p.src : p.region[r] + uint64_t(q) * slot;
    a.sum.src_stride[q] = elems;
  }
  a.vec16 = reinterpret_cast<uintptr_t>(p.src) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(p.region[0]) % 16 == 0;  // regions: 16-aligned alike
  a.sum.dst = p.dst;
  a.sum.dst_stride = elems;
  a.sum.rows = 1;
  a.sum.len = elems;
  a.sum.n = p.ch.n;
  a.ch = p.ch;
  a.skip_post = p.skip_post;
  a.poison = p.poison;
  const int blocks = int(std::clamp<uint64_t>((a.bytes + kBytesPerBlock - 1) / kBytesPerBlock, 1,
                                              uint64_t(std::max(p.sm_count, 1))));
  return with_elem_type(p.elem, [&](auto t) {
    return launch_typed<typename decltype(t)::type>(a, blocks, p.stream);
  });
}

cudaError_t load_one_shot_kernels() {
  return preload_sum_kernels([](auto t, auto packed) {
    return reinterpret_cast<const void*>(
        one_shot_kernel<typename decltype(t)::type, decltype(packed)::value>);
  });
}

}  // namespace pk::all_reduce
