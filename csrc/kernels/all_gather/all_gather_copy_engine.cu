// all_gather, copy-engine mechanism: the copy engines move every byte; three
// single-warp kernels carry the protocol, so no SM does data movement.
//
// Protocol for call epoch e on rank r, all on r's stream:
//   begin:  wait until every peer q has done[q] >= e-1, i.e. q finished
//           copying out what r pushed into q's workspace last call (credit).
//   push:   CE copies r's input into data[r] of every peer's workspace, and
//           into r's own output block.
//   post:   posted[r] = e on every peer (release), then wait for posted[q]>=e.
//   drain:  CE copies data[q] of our workspace into our output block q.
//   end:    done[r] = e on every peer (our data[q] may be reused), epoch = e.
#include "kernels/all_gather/all_gather.h"
#include "pk/cuda_check.h"
#include "pk/sync.cuh"

namespace pk::all_gather {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kSignalThreads = 32;  // one warp; thread q talks to rank q

// ---- arguments -------------------------------------------------------------
struct SignalArgs {
  Channel ch;
  bool skip_post;
};

// ---- roles -----------------------------------------------------------------

// ---- entry points ----------------------------------------------------------
__global__ void ce_begin_kernel(const __grid_constant__ SignalArgs a) {
  const int q = threadIdx.x;
  if (q >= a.ch.n || q == a.ch.rank) return;
  wait_geq(&a.ch.mine()->done[q], a.ch.next_epoch() - 1, a.ch.wait, q, kWaitDone);
}

__global__ void ce_post_kernel(const __grid_constant__ SignalArgs a) {
  const int q = threadIdx.x;
  if (q >= a.ch.n || q == a.ch.rank) return;
  const uint64_t e = a.ch.next_epoch();
  // The pushes before this kernel on the stream have completed; the fence
  // orders their visibility before the flag for a peer that acquires it.
  __threadfence_system();
  if (!a.skip_post) store_release_sys(&a.ch.flags[q]->posted[a.ch.rank], e);
  wait_geq(&a.ch.mine()->posted[q], e, a.ch.wait, q, kWaitPosted);
}

__global__ void ce_end_kernel(const __grid_constant__ SignalArgs a) {
  const int q = threadIdx.x;
  const uint64_t e = a.ch.next_epoch();
  if (q < a.ch.n && q != a.ch.rank) store_release_sys(&a.ch.flags[q]->done[a.ch.rank], e);
  __syncwarp();
  if (q == 0) a.ch.mine()->epoch = e;
}

// Output block q: rows of row_bytes at dst + q * row_bytes, pitch n * row_bytes.
cudaError_t copy_block(const Params& p, int q, const void* src, cudaStream_t s) {
  char* out = static_cast<char*>(p.dst) + size_t(q) * p.row_bytes;
  if (p.rows == 1)
    return cudaMemcpyAsync(out, src, p.row_bytes, cudaMemcpyDeviceToDevice, s);
  return cudaMemcpy2DAsync(out, size_t(p.n) * p.row_bytes, src, p.row_bytes,
                           p.row_bytes, p.rows, cudaMemcpyDeviceToDevice, s);
}

}  // namespace

cudaError_t launch_copy_engine(const Params& p) {
  SignalArgs a{};
  a.ch = make_channel(p.workspace, p.n, p.rank, p.slot, p.wait);
  a.skip_post = p.skip_post;
  const size_t block_bytes = p.rows * p.row_bytes;
  cudaStream_t s = p.stream;

  ce_begin_kernel<<<1, kSignalThreads, 0, s>>>(a);
  PK_CUDA_TRY(cudaGetLastError());
  for (int k = 1; k < p.n; ++k) {  // neighbours first, so links are spread
    const int q = (p.rank + k) % p.n;
    char* slot = p.workspace[q] + kDataOffset + size_t(p.rank) * block_bytes;
    PK_CUDA_TRY(cudaMemcpyAsync(slot, p.src, block_bytes, cudaMemcpyDeviceToDevice, s));
  }
  PK_CUDA_TRY(copy_block(p, p.rank, p.src, s));
  ce_post_kernel<<<1, kSignalThreads, 0, s>>>(a);
  PK_CUDA_TRY(cudaGetLastError());
  for (int q = 0; q < p.n; ++q) {
    if (q == p.rank) continue;
    PK_CUDA_TRY(copy_block(p, q, p.workspace[p.rank] + kDataOffset + size_t(q) * block_bytes, s));
  }
  ce_end_kernel<<<1, kSignalThreads, 0, s>>>(a);
  return cudaGetLastError();
}

cudaError_t load_copy_engine_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(ce_begin_kernel),
                           reinterpret_cast<const void*>(ce_post_kernel),
                           reinterpret_cast<const void*>(ce_end_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    PK_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
  }
  return cudaSuccess;
}

}  // namespace pk::all_gather
