// Ring attention backward, fused transport: one host sequence per call walks
// the whole ring (block-backward kernels, copy-engine pushes, stamp posts),
// so no XLA collective runs between the steps.
//
// Rank r of n (n >= 2), call epoch e. Block B_s is the K/V of rank r - s
// (B_0: our own). Step s: the block kernel (kernels/attention_bwd) of our
// queries against B_s adds into dq (zeroed at step 0) and writes B_s's dK/dV
// contribution (fp32); the partial dK/dV of B_s, the sum over ranks
// r - s .. r in ring order, goes on to rank r + 1 with it; after step n - 1
// the finished sum is cast to the input type and goes home to rank r + 1,
// the owner of B_{n-1}.
//   main:  wait_credit (every peer finished the last call's reads of what we
//          staged with it), stamp_table, fork the side and copy streams;
//   copy:  the copy engine pushes our stacked K/V into slot k of rank r + k's
//          region for k = 1 .. n - 1, nearest first, each followed by a stamp
//          copy (post 0) into that peer's posted[r] (direct pushes: on an
//          NVLink switch every pair has full bandwidth, so no forwarding
//          chain; the same layout as the forward's);
//   main, step s: (s >= 1) wait posted[r - s] >= post 0, the block kernel on
//          B_s (our kv, or our region's slot s); (s >= 1) wait posted[r - 1]
//          >= post s (rank r - 1's partial of B_s), then an fp32 add: the
//          partial += our contribution, in place in our region (the last
//          step: cast to the input type into a local buffer);
//   side:  after each step (an event from main), the copy engine pushes that
//          partial into slot s + 1 of rank r + 1's region (the last step:
//          its home slot), then a stamp copy posts s + 1 there. Every post
//          to rank r + 1 is on this stream after the copy stream's post 0
//          to it (an event), so a post implies every earlier one landed;
//   main:  wait posted[r - 1] >= post n (our own dK/dV came home), copy it
//          into dkv, join both streams, finish (done[r] = e to every peer;
//          dq and dkv poisoned if the call failed).
// The block kernels never wait and take no SM from the transfers: every
// transfer and post is a copy-engine copy, every wait a one-warp stream
// kernel (bounded, pk/sync.cuh). Each step's add starts after that step's
// block kernel, so the partial of B_s flies while rank r + 1 computes its
// step s + 1 contribution; the fp32 adds happen in ring order (r - s first),
// as in the XLA-collective ring: dK/dV are deterministic, dq (the kernel's
// reduce-adds) is not in its last bits.
// Region of rank r (peers write into it; no slot is reused within a call, so
// the credit wait of the next call is the only flow control):
//   [K/V slots 1..n-1: the stacked block B_s][partial slots 1..n-1: fp32
//   dK/dV of B_s][home: dK/dV of our block in the input type].
// Local scratch (an XLA buffer): the stamp table (n + 1 u64, in
// kStampBytes), the block kernel's fp32 dK/dV, step 0's partial (its push
// may still run when the next step's kernel writes), the cast home value.
// Safe aborts: a failed wait claims the device's error; the block kernel
// (dK/dV, dq fill) and the adds then write NaN, which travels on to the
// peers, and finish poisons dq and dkv. A CUDA error from an enqueue joins
// the streams and finishes the call as aborted.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::ring_attention_bwd {

using pk::DType;  // bf16 or fp16

inline constexpr size_t kStampBytes = 256;  // the stamp table: n + 1 <= kMaxRanks + 1 values
static_assert((kMaxRanks + 1) * sizeof(uint64_t) <= kStampBytes, "stamps fit");

// Byte offsets of the region and the scratch buffer, from the shapes.
struct Layout {
  int n = 2;
  size_t kv_bytes = 0;       // one stacked K/V block [2, B, T, Hkv, D] (input type)
  size_t partial_bytes = 0;  // its dK/dV in fp32

  size_t kv_slot(int s) const { return size_t(s - 1) * kv_bytes; }
  size_t partial_slot(int s) const {
    return size_t(n - 1) * kv_bytes + size_t(s - 1) * partial_bytes;
  }
  size_t home() const { return size_t(n - 1) * (kv_bytes + partial_bytes); }
  size_t region_bytes() const { return home() + kv_bytes; }
  // Scratch: [stamps][grads fp32][step 0's partial fp32][home value, input type].
  size_t scratch_stamps() const { return 0; }
  size_t scratch_grads() const { return kStampBytes; }
  size_t scratch_first() const { return kStampBytes + partial_bytes; }
  size_t scratch_home() const { return kStampBytes + 2 * partial_bytes; }
  size_t scratch_bytes() const { return kStampBytes + 2 * partial_bytes + kv_bytes; }
};

inline Layout make_layout(int n, int batch, int s_kv, int kv_heads, int head_dim) {
  const size_t elems = 2 * size_t(batch) * size_t(s_kv) * size_t(kv_heads) * size_t(head_dim);
  return Layout{n, elems * 2, elems * sizeof(float)};
}

struct Params {
  const void* q = nullptr;      // [B, S, Hq, D]
  const void* dout = nullptr;   // [B, S, Hq, D]
  const float* lse = nullptr;   // [B, Hq, S]
  const float* delta = nullptr; // [B, Hq, S]: rowsum(dout * out) - dlse
  const void* kv = nullptr;     // our block, K and V stacked [2, B, T, Hkv, D]
  const int32_t* ranks = nullptr;  // device table ranks[i] = i, i < n (the kernel's rank scalars)
  float* dq = nullptr;          // [B, S, Hq, D]
  void* dkv = nullptr;          // [2, B, T, Hkv, D], input type
  char* scratch = nullptr;      // Layout::scratch_bytes()
  int batch = 0, s_q = 0, s_kv = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;
  float scale = 1.0f;
  bool causal = false;
  bool zigzag = false;
  bool skip_post = false;       // testing: push the data but never post it
  Channel ch{};
  char* region[kMaxRanks] = {};
  cudaStream_t stream = nullptr;
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t copy_done = nullptr;

  Layout layout() const { return make_layout(ch.n, batch, s_kv, kv_heads, head_dim); }
};

// False when the extension was built without CUTLASS.
bool available();
// n >= 2 and what the block kernel takes (attention_bwd::supported).
bool supported(const Params& p);
cudaError_t run(const Params& p);

// The fp32 adds of the partial dK/dV (partial_sum.cu): acc += x, and
// out = cast(a + b) to the input type; NaN while the device holds an error
// (`claim`), so a failed call's garbage never reaches a peer as numbers.
cudaError_t add_partial(float* acc, const float* x, size_t count, const int32_t* claim,
                        cudaStream_t stream);
cudaError_t add_cast(void* out, DType type, const float* a, const float* b, size_t count,
                     const int32_t* claim, cudaStream_t stream);
cudaError_t load_kernels();

}  // namespace pk::ring_attention_bwd
