// The stream signal kernels of signals.h.
#include "pk/signals.h"

#include "pk/cuda_check.h"
#include "pk/post_layout.cuh"
#include "pk/sync.cuh"

namespace pk::signals {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 32;  // one block of one warp
static_assert(kMaxRanks <= kThreads, "one thread per rank");
// finish: one block; its threads poison the outputs of a failed call (a
// slow path: one block, whatever the size).
constexpr int kFinishThreads = 256;

// ---- arguments -------------------------------------------------------------
// The channel by value (__grid_constant__) and, for post/wait_posted, the
// peer addressed (kAllPeers: every peer) and the staged block's layout.

// ---- roles -----------------------------------------------------------------
// Thread q talks to rank q; true for the threads whose rank this call
// addresses (never our own).
__device__ __forceinline__ bool addressed(const Channel& ch, int peer, int q) {
  return q < ch.n && q != ch.rank && (peer == kAllPeers || peer == q);
}

// ---- entry points ----------------------------------------------------------
__global__ void wait_credit_kernel(const __grid_constant__ Channel ch) {
  const int q = threadIdx.x;
  const uint64_t e = ch.next_epoch();
  if (addressed(ch, kAllPeers, q) && !wait_geq(&ch.mine()->done[q], e - 1, ch.wait, q, kWaitDone)) {
    // The push that follows on this stream cannot be stopped: tell q first,
    // so that the call of q that may still read our slot poisons itself.
    // The mark is visible at q before this kernel ends, hence before the
    // push starts (signals.h).
    store_release_sys(&ch.flags[q]->clobbered[ch.rank], e);
    __threadfence_system();
  }
}

__global__ void post_kernel(const __grid_constant__ Channel ch, int peer, PostLayout layout) {
  const int q = threadIdx.x;
  __threadfence_system();
  if (addressed(ch, peer, q)) {
    publish_layout(ch, q, layout);
    store_release_sys(&ch.flags[q]->posted[ch.rank], ch.next_epoch());
  }
}

__global__ void __launch_bounds__(kFinishThreads) post_checked_kernel(
    const __grid_constant__ Channel ch, int peer, PostLayout layout,
    const __grid_constant__ Outputs remote) {
  const int q = threadIdx.x;
  if (__syncthreads_or(q == 0 && device_failed(ch.wait)))
    for (int i = 0; i < Outputs::kMax; ++i)
      if (remote.ptr[i] != nullptr)
        poison_bytes(remote.ptr[i], remote.bytes[i], remote.pattern, q, blockDim.x);
  __syncthreads();
  __threadfence_system();
  if (addressed(ch, peer, q)) {
    publish_layout(ch, q, layout);
    store_release_sys(&ch.flags[q]->posted[ch.rank], ch.next_epoch());
  }
}

__global__ void wait_posted_kernel(const __grid_constant__ Channel ch, int peer,
                                   PostLayout layout) {
  const int q = threadIdx.x;
  if (addressed(ch, peer, q)) wait_posted_layout(ch, q, layout);
}

__global__ void __launch_bounds__(kFinishThreads) finish_kernel(
    const __grid_constant__ Channel ch, const __grid_constant__ Outputs out, bool aborted) {
  const int q = threadIdx.x;
  const uint64_t e = ch.next_epoch();
  bool failed = false;
  if (addressed(ch, kAllPeers, q)) {
    // Everything this call read from its slots was read before this kernel
    // started (stream order). If this load misses q's mark, q's marking
    // store comes later, and q's push later still (its SC fence, then the
    // end of its kernel): after our reads. (Store buffering: SC fences on
    // both sides.)
    __threadfence_system();
    const uint64_t mark = load_acquire_sys(&ch.mine()->clobbered[q]);
    if (mark > e) {
      record_error(ch.wait, kErrClobbered, q, 0, e, mark);
      failed = true;
    }
    store_release_sys(&ch.flags[q]->done[ch.rank], e);
  }
  if (q == 0 && aborted) record_error(ch.wait, kErrAborted, -1, 0, 0, 0);
  failed = __syncthreads_or(failed || aborted || (q == 0 && device_failed(ch.wait)));
  if (failed)
    for (int i = 0; i < Outputs::kMax; ++i)
      if (out.ptr[i] != nullptr)
        poison_bytes(out.ptr[i], out.bytes[i], out.pattern, q, blockDim.x);
  __syncthreads();
  if (q == 0) ch.mine()->epoch = e;
}

__global__ void stamp_kernel(const __grid_constant__ Channel ch, int pieces) {
  const int i = threadIdx.x;
  if (i < pieces) ch.mine()->stamp[i] = (ch.next_epoch() - 1) * pieces + i + 1;
}

__global__ void stamp_table_kernel(const __grid_constant__ Channel ch, uint64_t* table,
                                   int count) {
  const uint64_t base = (ch.next_epoch() - 1) * uint64_t(count);
  for (int i = threadIdx.x; i < count; i += blockDim.x) table[i] = base + i + 1;
}

__global__ void wait_stamp_kernel(const __grid_constant__ Channel ch, int peer, int index,
                                  int count, bool mark) {
  const uint64_t e = ch.next_epoch();
  if (threadIdx.x == 0 &&
      !wait_geq(&ch.mine()->posted[peer], (e - 1) * uint64_t(count) + index + 1, ch.wait, peer,
                kWaitPosted) &&
      mark) {
    // A credit that never came: the copies after this kernel overwrite what
    // `peer` may still read in its call e, so that call poisons itself at
    // its finish (clobbered > e there; see wait_credit).
    store_release_sys(&ch.flags[peer]->clobbered[ch.rank], e + 1);
    __threadfence_system();
  }
}

}  // namespace

cudaError_t wait_credit(const Channel& ch, cudaStream_t stream) {
  wait_credit_kernel<<<1, kThreads, 0, stream>>>(ch);
  return cudaGetLastError();
}

cudaError_t post(const Channel& ch, int peer, const PostLayout& layout, bool skip,
                 cudaStream_t stream) {
  if (skip) return cudaSuccess;
  post_kernel<<<1, kThreads, 0, stream>>>(ch, peer, layout);
  return cudaGetLastError();
}

cudaError_t post_checked(const Channel& ch, int peer, const PostLayout& layout,
                         const Outputs& remote, bool skip, cudaStream_t stream) {
  if (skip) return cudaSuccess;
  post_checked_kernel<<<1, kFinishThreads, 0, stream>>>(ch, peer, layout, remote);
  return cudaGetLastError();
}

cudaError_t wait_posted(const Channel& ch, int peer, const PostLayout& layout,
                        cudaStream_t stream) {
  wait_posted_kernel<<<1, kThreads, 0, stream>>>(ch, peer, layout);
  return cudaGetLastError();
}

cudaError_t finish(const Channel& ch, const Outputs& outputs, cudaStream_t stream, bool aborted) {
  finish_kernel<<<1, kFinishThreads, 0, stream>>>(ch, outputs, aborted);
  return cudaGetLastError();
}

cudaError_t finish_after(cudaError_t err, const Channel& ch, const Outputs& outputs,
                         cudaStream_t stream) {
  if (err == cudaSuccess) return finish(ch, outputs, stream);
  finish(ch, outputs, stream, /*aborted=*/true);  // best effort
  return err;
}

cudaError_t join(cudaError_t err, cudaEvent_t joined, cudaStream_t side, cudaStream_t stream) {
  cudaError_t e = cudaEventRecord(joined, side);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, joined, 0);
  return err != cudaSuccess ? err : e;
}

cudaError_t stamp(const Channel& ch, int pieces, cudaStream_t stream) {
  if (pieces < 1 || pieces > kMaxStamps) return cudaErrorInvalidValue;
  stamp_kernel<<<1, kThreads, 0, stream>>>(ch, pieces);
  return cudaGetLastError();
}

cudaError_t stamp_table(const Channel& ch, uint64_t* table, int count, cudaStream_t stream) {
  if (count < 1 || table == nullptr) return cudaErrorInvalidValue;
  stamp_table_kernel<<<1, kThreads, 0, stream>>>(ch, table, count);
  return cudaGetLastError();
}

cudaError_t wait_stamp(const Channel& ch, int peer, int index, int count, cudaStream_t stream,
                       bool mark_clobbered) {
  if (peer < 0 || peer >= ch.n || peer == ch.rank || index < 0 || index >= count)
    return cudaErrorInvalidValue;
  wait_stamp_kernel<<<1, kThreads, 0, stream>>>(ch, peer, index, count, mark_clobbered);
  return cudaGetLastError();
}

cudaError_t load_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(wait_credit_kernel),
                           reinterpret_cast<const void*>(post_kernel),
                           reinterpret_cast<const void*>(post_checked_kernel),
                           reinterpret_cast<const void*>(wait_posted_kernel),
                           reinterpret_cast<const void*>(finish_kernel),
                           reinterpret_cast<const void*>(stamp_kernel),
                           reinterpret_cast<const void*>(stamp_table_kernel),
                           reinterpret_cast<const void*>(wait_stamp_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    PK_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
  }
  return cudaSuccess;
}

}  // namespace pk::signals
