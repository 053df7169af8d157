// Ring attention backward, fused transport: one host sequence per call walks
// the whole ring (block-backward kernels, copy-engine pushes, stamp posts),
// so no XLA collective runs between the steps.
//
// Rank r of n (n >= 2), call epoch e; prev = r - 1, next = r + 1. Block B_s
// is the K/V of rank r - s (B_0: our own). Step s: the block kernel
// (kernels/attention_bwd) of our queries against B_s adds into dq (zeroed at
// step 0) and writes B_s's dK/dV contribution (fp32); the partial dK/dV of
// B_s, the sum over ranks r - s .. r in ring order, goes on to next; after
// step n - 1 the finished sum is cast to the input type and goes home to
// next, the owner of B_{n-1}. K/V travel hop by hop with it: B_s reaches
// next from us (we forward what prev forwarded to us), so every transfer is
// r -> r + 1 and the staging region holds two K/V slots (B_s in slot s % 2:
// one read by this step's kernel, one filling for the next) and one partial
// slot, whatever n.
//   main:  wait_credit (every peer finished the last call), stamp_table,
//          fork the side stream; step 0: the block kernel on our kv into acc
//          (scratch); step s >= 1: wait posted[prev] >= kv(s), the block
//          kernel on slot s % 2 into grads; wait posted[prev] >= partial(s)
//          and for the side stream's push of acc (event); the fp32 add
//          acc = partial slot + grads (the last step: cast to the input type
//          into home_value); then let the side stream go on (event). At the
//          end: wait posted[prev] >= home (our dK/dV, in our partial slot),
//          copy it into dk and dv, join, finish (done[r] = e to every peer;
//          dq, dk and dv poisoned if the call failed).
//   side:  first our k and v into next's slot 1, post kv(1); then after main's
//          step s: (s >= 1) post credit(s) to prev (our partial slot and K/V
//          slot s % 2 are free: the add read the first, the kernel and our
//          forward of B_s the second), wait next's credit(s) (marking next's
//          channel clobbered on a timeout), push acc into next's partial
//          slot and post partial(s + 1) (the last step: home_value, post
//          home); (s + 2 <= n - 1) wait posted[prev] >= kv(s + 1), NaN our
//          slot (s + 1) % 2 if the device failed, push it into next's slot
//          (s + 2) % 2 and post kv(s + 2).
// Every post of a rank is a stamp copy on its side stream, in the order of
// Posts (below), so each posted[] flag grows monotonically even at n = 2,
// where prev = next receives both data posts and credits, and a post implies
// every earlier one of that rank landed. A credit is posted before the
// matching wait, so no cycle of waits closes around the ring.
// The block kernels never wait and take no SM from the transfers: every
// transfer and post is a copy-engine copy, every wait a one-warp stream
// kernel (bounded, pk/sync.cuh). The fp32 adds happen in ring order (r - s
// first), as in the XLA-collective ring: dK/dV are deterministic (bitwise
// those of the XLA transport), dq (the kernel's reduce-adds) is not in its
// last bits.
// Region of rank r (2 kv_bytes + partial_bytes = 8 bytes per element of one
// K block, for every n): [K/V slot 0][K/V slot 1][partial slot: fp32 dK/dV
// of the block that visits; at the end our own dK/dV in the input type].
// Local scratch (an XLA buffer): the stamp table (Posts::count u64, in
// kStampBytes), the block kernel's fp32 dK/dV, acc (the partial we push),
// the cast home value.
// Safe aborts: a failed wait claims the device's error; the block kernel
// (dK/dV, dq fill), the adds and the forwarded K/V then carry NaN on to the
// peers, a failed credit wait marks the peer clobbered, and finish poisons
// dq, dk and dv. A CUDA error from an enqueue joins the streams and finishes
// the call as aborted.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention_bwd/attention_bwd.h"
#include "kernels/common/dtype.h"
#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::ring_attention_bwd {

using pk::DType;  // bf16 or fp16

// Post indices of one call (stamp_table's table), in the order a rank's
// side stream issues them: kv(1); then for s = 0 .. n - 1: credit(s) to
// prev (s >= 1), partial(s + 1) to next (the last step: home), kv(s + 2) to
// next (s + 2 <= n - 1). Both ends compute them alike.
struct Posts {
  int kv[kMaxRanks] = {};       // kv[s]: B_s is in the receiver's slot s % 2 (s = 1 .. n - 1)
  int partial[kMaxRanks] = {};  // partial[s]: the partial of B_s is in its partial slot
  int credit[kMaxRanks] = {};   // credit[s]: the receiver's slots of step s are free (to prev)
  int home = 0;                 // the finished dK/dV is in the owner's partial slot
  int count = 0;                // 3n - 2
};

inline Posts make_posts(int n) {
  Posts p;
  int i = 0;
  p.kv[1] = i++;
  for (int s = 0; s < n; ++s) {
    if (s >= 1) p.credit[s] = i++;
    if (s < n - 1) p.partial[s + 1] = i++;
    else p.home = i++;
    if (s + 2 <= n - 1) p.kv[s + 2] = i++;
  }
  p.count = i;
  return p;
}

inline constexpr size_t kStampBytes = 512;  // the stamp table: 3n - 2 <= 3 kMaxRanks - 2 values
static_assert((3 * kMaxRanks - 2) * sizeof(uint64_t) <= kStampBytes, "stamps fit");

// Byte offsets of the region and the scratch buffer, from the shapes.
struct Layout {
  int n = 2;
  size_t kv_bytes = 0;       // one K/V block, K then V [2, B, T, Hkv, D] (input type)
  size_t partial_bytes = 0;  // its dK/dV in fp32

  // One of K and V (input type): V follows K in a slot, dV follows dK in
  // the home value, and each is one of the call's operands or results.
  size_t k_bytes() const { return kv_bytes / 2; }
  size_t kv_slot(int s) const { return size_t(s % 2) * kv_bytes; }
  // The partial dK/dV of the visiting block, then (home) our own dK/dV.
  size_t partial() const { return 2 * kv_bytes; }
  size_t region_bytes() const { return partial() + partial_bytes; }
  // Scratch: [stamps][grads fp32][acc fp32][home value, input type].
  size_t scratch_stamps() const { return 0; }
  size_t scratch_grads() const { return kStampBytes; }
  size_t scratch_acc() const { return kStampBytes + partial_bytes; }
  size_t scratch_home() const { return kStampBytes + 2 * partial_bytes; }
  size_t scratch_bytes() const { return kStampBytes + 2 * partial_bytes + kv_bytes; }
};

inline Layout make_layout(int n, int batch, int s_kv, int kv_heads, int head_dim) {
  const size_t elems = 2 * size_t(batch) * size_t(s_kv) * size_t(kv_heads) * size_t(head_dim);
  return Layout{n, elems * 2, elems * sizeof(float)};
}

struct Params {
  // Our queries against our own block (attention_bwd::Params): q, dout,
  // lse, delta' (rowsum(dout * out) - dlse), k and v [B, T, Hkv, D], the
  // dimensions, type, scale, mask and ring size. Each step's kernel takes
  // it with that step's K/V, ranks and outputs (the rest of its fields are
  // set per step).
  attention_bwd::Params block;
  const int32_t* ranks = nullptr;  // device table ranks[i] = i, i < n (the kernel's rank scalars)
  float* dq = nullptr;          // [B, S, Hq, D]
  void* dk = nullptr;           // [B, T, Hkv, D], input type
  void* dv = nullptr;
  char* scratch = nullptr;      // Layout::scratch_bytes()
  bool skip_post = false;       // testing: push the data but never post it
  Channel ch{};
  char* region[kMaxRanks] = {};
  cudaStream_t stream = nullptr;
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;

  Layout layout() const {
    return make_layout(ch.n, block.batch, block.s_kv, block.kv_heads, block.head_dim);
  }
};

// False when the extension was built without CUTLASS.
bool available();
// n >= 2, the ring size of `block`, and what the block kernel takes
// (attention_bwd::supported).
bool supported(const Params& p);
cudaError_t run(const Params& p);

// The fp32 adds of the partial dK/dV (partial_sum.cu): out = a + b, and
// out = cast(a + b) to the input type; NaN while the device holds an error
// (`claim`), so a failed call's garbage never reaches a peer as numbers.
cudaError_t add_partial(float* out, const float* a, const float* b, size_t count,
                        const int32_t* claim, cudaStream_t stream);
cudaError_t add_cast(void* out, DType type, const float* a, const float* b, size_t count,
                     const int32_t* claim, cudaStream_t stream);
// NaN over `bytes` (a multiple of 16) at `p` while the device holds an
// error: a K/V block forwarded after a wait that gave up reaches the next
// rank as NaN, never as numbers.
cudaError_t poison_if_failed(void* p, size_t bytes, const int32_t* claim, cudaStream_t stream);
cudaError_t load_kernels();

}  // namespace pk::ring_attention_bwd
