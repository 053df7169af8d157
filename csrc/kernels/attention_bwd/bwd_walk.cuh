// Which query tiles one CTA of the block backward visits, and which of them
// need the element-wise causal mask (host and device: tests/native checks it
// against the reference positions).
//
// A CTA owns one K/V tile (tile_kv rows of the visiting block, one K/V head)
// and walks (query head of the GQA group, query tile), heads outer. Causal:
// a query tile whose last token comes before the K/V tile's first key sees
// nothing and is skipped; one whose first token comes before the K/V tile's
// last key crosses the diagonal and is masked. Tokens are global positions
// (kv_walk.cuh's Geometry: contiguous or zigzag over a ring of n); tiles
// never straddle a zigzag chunk (the host checks the row counts), so a
// tile's rows are consecutive tokens.
#pragma once

#include <cstdint>

#include "kernels/ring_attention/kv_walk.cuh"

namespace pk::attention_bwd {

using ring_attention::Geometry;

// Everything about the block pair the kernel needs besides the tensors.
struct BwdArgs {
  int n = 1;            // ring size
  int s_q = 0;          // query rows (this rank's block)
  int s_kv = 0;         // K/V rows (the visiting block)
  bool zigzag = false;
  bool causal = false;
  int group = 1;        // query heads per K/V head
  float scale = 1.0f;
  const int32_t* q_rank = nullptr;  // device scalars (the kernel reads them)
  const int32_t* k_rank = nullptr;
};

class BwdWalk {
 public:
  PK_HD BwdWalk(const BwdArgs& a, int q_rank, int k_rank, int kv_tile, int tile_q, int tile_kv)
      : q_geo_{q_rank, a.n, a.s_q, a.zigzag, a.causal},
        causal_(a.causal),
        group_(a.group),
        tile_q_(tile_q),
        tiles_q_(a.s_q / tile_q),
        chunk_tiles_(q_geo_.chunk_rows() / tile_q),
        head_(tiles_q_ > 0 ? 0 : a.group),
        q_first_(q_geo_.chunk_start(q_rank, 0)) {
    const Geometry k_geo{k_rank, a.n, a.s_kv, a.zigzag, a.causal};
    k_first_ = k_geo.token(k_rank, kv_tile * tile_kv);
    k_last_ = k_first_ + tile_kv - 1;
  }

  // Global token of the K/V tile's first row.
  PK_HD int k_first() const { return k_first_; }

  // The next visible tile: head in the group, query tile, global token of
  // its first query, whether some key comes after some query. False at the end.
  PK_HD bool next(int& head, int& q_tile, int& q_first, bool& masked) {
    while (head_ < group_) {
      head = head_;
      q_tile = q_tile_;
      q_first = q_first_;
      advance();
      if (causal_ && q_first + tile_q_ - 1 < k_first_) continue;  // wholly hidden: skip
      masked = causal_ && k_last_ > q_first;
      return true;
    }
    return false;
  }

 private:
  // On to the next (head, query tile), without a division: a tile's first
  // token moves by tile_q within a chunk, to the second chunk's start (zigzag)
  // at the first's end, and back to the first chunk's for the next head.
  PK_HD void advance() {
    if (++q_tile_ == tiles_q_) {
      q_tile_ = 0;
      ++head_;
      q_first_ = q_geo_.chunk_start(q_geo_.rank, 0);
    } else if (q_tile_ == chunk_tiles_) {
      q_first_ = q_geo_.chunk_start(q_geo_.rank, 1);
    } else {
      q_first_ += tile_q_;
    }
  }

  Geometry q_geo_;
  bool causal_;
  int group_, tile_q_, tiles_q_, chunk_tiles_;
  int head_, q_tile_ = 0, q_first_;
  int k_first_ = 0, k_last_ = 0;
};

}  // namespace pk::attention_bwd
