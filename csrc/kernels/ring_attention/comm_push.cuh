// The communicator CTAs of mechanism ld_st: inside the fused attention
// kernel, the first PushArgs::ctas CTAs push our K and V block into every
// peer's region while the compute CTAs attend (ParallelKittens' inter-SM
// split: communicator SMs beside compute SMs).
//
// Work: for each peer, nearest first (PushLayout::peer(1), (2), ...), for
// each piece i, the piece's bytes of every batch of K and of V (the slots
// and pieces of the copy-engine path, so the compute side's per-piece waits
// are unchanged) are cut into chunks of blockDim.x * kCopyUnroll 16-byte
// vectors (pk/copy.cuh); CTA c copies chunks c, c + ctas, ... with plain
// loads of our memory and stores over NVLink into the peer's.
//
// Posting piece i to peer q, call epoch e: every CTA, after its stores of
// the piece, synchronizes its threads; then one thread releases them
// (fence.acq_rel.sys) and adds one to arrive[k - 1][i] in OUR OWN channel
// flags. The CTA whose add brings the counter to e * ctas (monotonic, never
// reset; the CTA count is part of the channel key) acquires the others'
// stores and release-stores (e - 1) * pieces + i + 1, the copy engine's
// stamp value, into q's posted[r]. A CTA adds for piece i + 1 only after it
// posted piece i (if it was the last), so the value a peer sees only grows
// and a posted piece implies all earlier ones.
//
// Nothing here waits: the communicator CTAs finish on their own, whatever
// the peers do, so the compute CTAs' bounded waits are the only waits. They
// push even when the credit wait before the kernel timed out (a peer may
// still read its slots): that wait marked the peer first, and the peer's
// call that read the slot poisons itself (pk/signals.h).
#pragma once

#include <cstdint>

#include "kernels/ring_attention/ring_attention.h"
#include "pk/copy.cuh"
#include "pk/sync.cuh"

namespace pk::ring_attention {

// Vectors: the block sizes are multiples of 128 bytes and the host checks
// that k and v are 16-byte aligned (so are the regions).
using PushVector = uint4;

// Called by the communicator CTAs (blockIdx.x < a.ctas) only.
__device__ inline void push_kv(const PushArgs& a) {
  using V = PushVector;
  const PushLayout& L = a.layout;
  const Channel& ch = a.ch;
  const uint64_t epoch = ch.next_epoch();  // finish() advances it after the kernel
  const uint32_t target = uint32_t(epoch) * uint32_t(a.ctas);
  const uint64_t piece_vecs = L.piece_bytes() / sizeof(V);
  const uint64_t chunk = uint64_t(blockDim.x) * kCopyUnroll;
  const uint64_t chunks = (piece_vecs + chunk - 1) / chunk;  // per batch, of K or of V
  const uint64_t units = 2 * uint64_t(L.batch) * chunks;     // (batch, K/V, chunk), chunk fastest
  for (int k = 1; k < L.n; ++k) {
    const int q = L.peer(k);
    for (int i = 0; i < L.pieces; ++i) {
      const size_t off = size_t(i) * L.piece_bytes();
      for (uint64_t u = blockIdx.x; u < units; u += uint64_t(a.ctas)) {
        const uint64_t c = u % chunks, bv = u / chunks;
        const int b = int(bv >> 1);
        const bool is_v = bv & 1;
        const char* src = (is_v ? a.v : a.k) + size_t(b) * L.row_bytes + off;
        char* dst = a.region[q] + (is_v ? L.v_offset() : 0) + L.slot(k, b) + off;
        copy_chunk(RowBlock<V>{reinterpret_cast<const V*>(src), reinterpret_cast<V*>(dst), 1,
                               piece_vecs, 0},
                   c * chunk);
      }
      __syncthreads();  // the CTA's stores of this piece, before its arrival
      if (threadIdx.x == 0 && arrive_last(&ch.mine()->arrive[k - 1][i], target) && !a.skip_post)
        store_release_sys(&ch.flags[q]->posted[ch.rank],
                          (epoch - 1) * uint64_t(L.pieces) + uint64_t(i) + 1);
    }
  }
}

}  // namespace pk::ring_attention
