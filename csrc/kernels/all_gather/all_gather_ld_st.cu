// all_gather, ld/st mechanism: one kernel, zero copy, push or pull.
//
// Push: every rank stores its block into every peer's output (it publishes
// its output address). Pull: every rank loads every peer's block into its own
// output (it publishes its input address). Protocol for call epoch e on rank r
// (every counter is monotonic; pk/offer.h has the offers in full):
//   1. offer:   r stores its address and its layout (rows, row_bytes) into
//               ptr/rows/row_bytes[r] of every peer's channel, then raises
//               offer[r] there to "offered for e" (release). Every block does
//               this; it is idempotent, so no block depends on block 0 being
//               scheduled.
//   2. claim:   for each rank q, wait until our offer[q] is q's for e
//               (acquire), claim it (compare-and-swap to "claimed"), read
//               ptr[q] and check q's layout against ours. A wait that times
//               out, an offer q revoked (it gave up before we came) and a
//               layout that differs (another program on the channel) are
//               errors, and we never touch q's buffer.
//   3. copy:    the grid moves all claimed ranks' blocks, chunk by chunk.
//   4. done:    the last block to finish releases done[r] = e to every peer,
//               then waits for done[q] >= e from every peer before the kernel
//               ends: XLA may reuse our input and output buffers as soon as we
//               return, and a peer may still be reading or writing them. If
//               that wait fails, r revokes its offer to q; if q had claimed it
//               already, r waits a second full timeout for q's done and
//               records `unsafe` if even that fails. Then, if the device holds
//               an error, the output is poisoned (every byte the pattern the
//               host picked for the dtype), and the epoch advances.
// A rank cannot offer epoch e+1 before every peer finished epoch e or had its
// offer revoked (step 4), so one set of flags per channel suffices.
#include <algorithm>
#include <atomic>

#include "kernels/all_gather/all_gather.h"
#include "pk/copy.cuh"
#include "pk/cuda_check.h"
#include "pk/offer.h"
#include "pk/sync.cuh"

namespace pk::all_gather {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 512;

// Pull: read every peer's input into our output. Push: write our input into
// every peer's output. Same handshake; the published address differs.
enum Direction { kPull, kPush };

// ---- arguments -------------------------------------------------------------
struct LdStArgs {
  const void* src;
  void* dst;
  uint64_t rows;
  uint64_t row_bytes;
  Channel ch;
  bool skip_post;
  uint8_t poison;  // byte pattern of a failed call's output
};

// ---- roles -----------------------------------------------------------------
// Ready once rank q's offer word shows call `epoch` (or anything later).
struct Arrived {
  uint64_t epoch;
  __device__ __forceinline__ bool operator()(uint64_t w) const {
    return offer::arrived(w, epoch);
  }
};

// Thread q < n offers our buffer to peer q, then claims rank q's offer and
// resolves its address (ok_of[q]: we hold the offer and q's layout is ours).
__device__ void offer_and_claim(const LdStArgs& a, uint64_t epoch, const void* mine_ptr,
                                const char** peer_ptr, bool* ok_of) {
  const int q = threadIdx.x;
  if (q >= a.ch.n) return;
  SlotFlags* mine = a.ch.mine();
  if (q == a.ch.rank) {
    peer_ptr[q] = static_cast<const char*>(mine_ptr);
    ok_of[q] = true;
    return;
  }
  const int r = a.ch.rank;
  if (!a.skip_post) {
    SlotFlags* theirs = a.ch.flags[q];
    store_relaxed_sys(&theirs->ptr[r], reinterpret_cast<uint64_t>(mine_ptr));
    store_relaxed_sys(&theirs->rows[r], a.rows);
    store_relaxed_sys(&theirs->row_bytes[r], a.row_bytes);
    max_release_sys(&theirs->offer[r], offer::word(epoch, offer::kOffered));
  }
  ok_of[q] = false;
  peer_ptr[q] = nullptr;
  uint64_t seen;
  if (!spin_bounded<true>(&mine->offer[q], Arrived{epoch}, a.ch.wait, q, kWaitOffer, epoch, &seen))
    return;  // timed out (recorded)
  uint64_t swapped = seen;
  if (offer::classify(seen, epoch) == offer::Seen::kClaimable)
    swapped = cas_acq_rel_sys(&mine->offer[q], seen, offer::word(epoch, offer::kClaimed));
  if (!offer::claimed(seen, swapped, epoch)) {
    // q gave up on this call before we came (or is past it): its buffer is
    // no longer its to lend.
    record_error(a.ch.wait, kErrRevoked, q, 0, epoch,
                 offer::classify(seen, epoch) == offer::Seen::kClaimable ? swapped : seen);
    return;
  }
  // Acquired (our swap, or the load that saw another block's claim): q's
  // address and layout for this call are visible and stay until our done.
  const uint64_t rows = load_relaxed_sys(&mine->rows[q]);
  const uint64_t row_bytes = load_relaxed_sys(&mine->row_bytes[q]);
  if (!offer::same_layout(a.rows, a.row_bytes, rows, row_bytes)) {
    record_error(a.ch.wait, kErrLayout, q, 0, a.rows, rows, a.row_bytes, row_bytes);
    return;  // never copy with another shape: that could run past q's buffer
  }
  peer_ptr[q] = reinterpret_cast<const char*>(load_relaxed_sys(&mine->ptr[q]));
  ok_of[q] = true;
}

// After our done wait for peer q failed: take back our offer to q, or, if q
// holds it, wait (bounded again) until q is done with our buffer.
__device__ void settle(const LdStArgs& a, int q, uint64_t epoch) {
  const uint64_t old = cas_acq_rel_sys(&a.ch.flags[q]->offer[a.ch.rank],
                                       offer::word(epoch, offer::kOffered),
                                       offer::word(epoch, offer::kRevoked));
  if (offer::revoke_outcome(old, epoch) != offer::Revoke::kInUse) return;
  uint64_t seen;
  if (!wait_geq_patient(&a.ch.mine()->done[q], epoch, a.ch.wait, &seen))
    record_unsafe(a.ch.wait, q, epoch, seen);
}

// Called by every block after its copies. Returns in all blocks but the last;
// the last one releases the peers, waits until they are done with us (or
// takes its offers back), poisons the output if the call failed, and
// advances the epoch.
__device__ void finish(const LdStArgs& a, uint64_t epoch) {
  __shared__ bool is_last;
  SlotFlags* mine = a.ch.mine();
  __syncthreads();
  if (threadIdx.x == 0) {
    // System scope: a peer GPU observes our reads of its input (pull) or
    // our writes into its output (push) through the done flag.
    __threadfence_system();
    is_last = atomicAdd(&mine->ticket, 1u) == gridDim.x - 1;
    __threadfence();  // the last block sees every block's work
  }
  __syncthreads();
  if (!is_last) return;
  const int q = threadIdx.x;
  if (q < a.ch.n && q != a.ch.rank) {
    store_release_sys(&a.ch.flags[q]->done[a.ch.rank], epoch);
    if (!wait_geq(&mine->done[q], epoch, a.ch.wait, q, kWaitDone)) settle(a, q, epoch);
  }
  // No peer writes into our output any more (push): a failed call's output
  // becomes poison, whatever parts of it were written.
  if (__syncthreads_or(threadIdx.x == 0 && device_failed(a.ch.wait)))
    poison_bytes(a.dst, uint64_t(a.ch.n) * a.rows * a.row_bytes, a.poison, threadIdx.x,
                 blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    mine->ticket = 0;      // every block of this call has taken its ticket
    mine->epoch = epoch;   // the next call on this stream sees it
  }
}

// ---- entry point -----------------------------------------------------------
template <typename V, Direction kDir>
__global__ void __launch_bounds__(kThreads) all_gather_ld_st_kernel(
    const __grid_constant__ LdStArgs a) {
  __shared__ const char* peer_ptr[kMaxRanks];
  __shared__ bool ok_of[kMaxRanks];
  // Read before any ticket is taken, so every block sees the same value.
  const uint64_t epoch = a.ch.next_epoch();
  offer_and_claim(a, epoch, kDir == kPull ? a.src : a.dst, peer_ptr, ok_of);
  __syncthreads();

  // Chunks of all ranks' blocks are interleaved over the grid, so the local
  // copy of our own block runs beside the NVLink traffic, not after it.
  const uint64_t row_vecs = a.row_bytes / sizeof(V);
  const uint64_t chunk = uint64_t(blockDim.x) * kCopyUnroll;
  const uint64_t chunks_per_rank = (a.rows * row_vecs + chunk - 1) / chunk;
  const uint64_t total = chunks_per_rank * a.ch.n;
  for (uint64_t c = blockIdx.x; c < total; c += gridDim.x) {
    // Chunk c is chunk c / n of rank q's block. Starting at our neighbour
    // makes the ranks talk to different peers.
    const int q = int((c + a.ch.rank + 1) % a.ch.n);
    if (!ok_of[q]) continue;  // no usable offer: leave that part (poisoned at the end)
    const uint64_t stride = uint64_t(a.ch.n) * row_vecs;
    const RowBlock<V> b =
        kDir == kPull
            ? RowBlock<V>{reinterpret_cast<const V*>(peer_ptr[q]),
                          reinterpret_cast<V*>(a.dst) + q * row_vecs, a.rows, row_vecs, stride}
            : RowBlock<V>{reinterpret_cast<const V*>(a.src),
                          reinterpret_cast<V*>(const_cast<char*>(peer_ptr[q])) +
                              a.ch.rank * row_vecs,
                          a.rows, row_vecs, stride};
    copy_chunk(b, (c / a.ch.n) * chunk);
  }
  finish(a, epoch);
}

template <typename V>
cudaError_t launch_typed(const LdStArgs& a, bool push, int blocks, cudaStream_t stream) {
  if (push)
    all_gather_ld_st_kernel<V, kPush><<<blocks, kThreads, 0, stream>>>(a);
  else
    all_gather_ld_st_kernel<V, kPull><<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Widest access that divides every offset the kernel forms.
int access_width(const Params& p) {
  return pk::access_width(p.row_bytes | reinterpret_cast<uintptr_t>(p.src) |
                         reinterpret_cast<uintptr_t>(p.dst));
}

const void* const kKernels[] = {
#define PK_AG_KERNELS(V)                                              \
  reinterpret_cast<const void*>(all_gather_ld_st_kernel<V, kPull>), \
      reinterpret_cast<const void*>(all_gather_ld_st_kernel<V, kPush>)
    PK_AG_KERNELS(uint4), PK_AG_KERNELS(uint2), PK_AG_KERNELS(unsigned int),
    PK_AG_KERNELS(unsigned short), PK_AG_KERNELS(unsigned char)};
#undef PK_AG_KERNELS

// A device's grid limits: its SMs, and the blocks of every variant that are
// co-resident (the most a grid may have: blocks spin on their peers).
struct GridLimits {
  int sms = 0;
  int co_resident = 0;
};

cudaError_t find_limits(int device, GridLimits* out) {
  int per_sm = 1 << 30;
  for (const void* k : kKernels) {
    int n = 0;
    PK_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kThreads, 0));
    per_sm = std::min(per_sm, n);
  }
  PK_CUDA_TRY(cudaDeviceGetAttribute(&out->sms, cudaDevAttrMultiProcessorCount, device));
  out->co_resident = std::max(per_sm, 1) * out->sms;
  return cudaSuccess;
}

// Filled per device by load_ld_st_kernels (so launches query nothing); a device
// beyond the table is queried at each launch (neither call synchronizes).
constexpr int kCachedDevices = 64;
std::atomic<int> g_sms[kCachedDevices];
std::atomic<int> g_co_resident[kCachedDevices];

cudaError_t grid_limits(int device, GridLimits* out) {
  if (device >= 0 && device < kCachedDevices) {
    out->sms = g_sms[device].load(std::memory_order_acquire);
    out->co_resident = g_co_resident[device].load(std::memory_order_relaxed);
    if (out->sms > 0) return cudaSuccess;
  }
  return find_limits(device, out);
}

}  // namespace

cudaError_t run_ld_st(const Params& p, bool push) {
  LdStArgs a{};
  a.src = p.src;
  a.dst = p.dst;
  a.rows = p.rows;
  a.row_bytes = p.row_bytes;
  a.ch = p.ch;
  a.skip_post = p.skip_post;
  a.poison = p.poison;

  // One block per chunk (see the kernel), at most one per SM by default or
  // num_blocks up to the co-resident limit.
  GridLimits lim;
  PK_CUDA_TRY(grid_limits(p.device, &lim));
  const int cap = p.num_blocks > 0 ? std::min(p.num_blocks, lim.co_resident) : lim.sms;
  const int width = access_width(p);
  const uint64_t chunk_bytes = uint64_t(kThreads) * kCopyUnroll * width;
  const uint64_t chunks = p.ch.n * ((p.rows * p.row_bytes + chunk_bytes - 1) / chunk_bytes);
  const int blocks = int(std::clamp<uint64_t>(chunks, 1, uint64_t(cap)));
  return with_access_width(width, [&](auto vec) {
    return launch_typed<typename decltype(vec)::type>(a, push, blocks, p.stream);
  });
}

cudaError_t load_ld_st_kernels() {
  for (const void* k : kKernels) PK_CUDA_TRY(preload_kernel(k));
  int device = 0;
  PK_CUDA_TRY(cudaGetDevice(&device));
  GridLimits lim;
  PK_CUDA_TRY(find_limits(device, &lim));
  if (device < kCachedDevices) {
    g_co_resident[device].store(lim.co_resident, std::memory_order_relaxed);
    g_sms[device].store(lim.sms, std::memory_order_release);
  }
  return cudaSuccess;
}

}  // namespace pk::all_gather
