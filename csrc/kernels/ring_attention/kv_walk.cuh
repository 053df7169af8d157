// Where every row of the ring lives, and the order in which one query tile
// visits the K/V tiles of the whole ring.
//
// Rank r holds s_local rows of q, k and v. Their global token positions:
//   contiguous: rows [0, s_local) are tokens r * s_local + j;
//   zigzag:     the sequence is cut into 2n chunks of c = s_local / 2 tokens;
//               rows [0, c) are chunk r, rows [c, s_local) chunk 2n - 1 - r.
// A query tile never straddles a chunk (the host checks c % tile_q == 0), so
// its rows are consecutive tokens.
//
// Walk order: our own block first (it is there when the kernel starts), then
// the blocks of ranks r - 1, r - 2, ... in the order the copy engines deliver
// them. Causal walks skip the K tiles that lie wholly after the query tile's
// last token and flag the tiles that cross its first token for masking.
// Key tiles that do not divide a chunk (176 keys in a chunk of 8192): the
// last tile of each chunk ends at the chunk's end, overlapping the tile
// before it; its leading keys that tile already covered are masked (`skip`),
// so no tile reads past its chunk (the kernel checks chunk rows >= tile_k).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define PK_HD __host__ __device__ __forceinline__
#else
#define PK_HD inline
#endif

namespace pk::ring_attention {

struct Geometry {
  int rank = 0;
  int n = 1;
  int s_local = 0;   // rows per rank
  bool zigzag = false;
  bool causal = false;

  PK_HD int chunks() const { return zigzag ? 2 : 1; }
  PK_HD int chunk_rows() const { return zigzag ? s_local / 2 : s_local; }
  // Global token of the first row of chunk `c` of rank `src`'s block.
  PK_HD int chunk_start(int src, int c) const {
    const int rows = chunk_rows();
    if (!zigzag) return src * rows;
    return (c == 0 ? src : 2 * n - 1 - src) * rows;
  }
  // Global token of row `j` of rank `src`'s block.
  PK_HD int token(int src, int j) const {
    const int rows = chunk_rows();
    return chunk_start(src, j / rows) + j % rows;
  }
};

// Element strides of a row-major [B, rows, heads, D] tensor (q, k, v, out,
// the peers' K/V in a region, dq), 64-bit: rows * heads * D passes 2^31 at
// sizes a GPU holds (s_local = 131072, Hq = 128, D = 128), and the peers'
// K/V batch stride (n - 1) * s_local * Hkv * D sooner. The kernels' cute
// strides are built from these (attention_sm90.cuh, attention_bwd_sm90.cuh).
struct TensorStrides {
  int64_t row = 0;    // one token
  int64_t head = 0;   // one head
  int64_t batch = 0;  // one batch entry
  PK_HD static TensorStrides of(int64_t rows, int64_t heads, int64_t dim) {
    TensorStrides s;
    s.row = heads * dim;
    s.head = dim;
    s.batch = rows * heads * dim;
    return s;
  }
};

// Where our K/V block goes in the peers' regions (both mechanisms push the
// same bytes to the same places). A region holds the n - 1 peer blocks, K
// then V, each as [B, (n - 1) * s_local, Hkv, D]: the block of the rank k
// behind the owner is slot k - 1, so batch b of it starts at
// (b * (n - 1) + k - 1) * row_bytes. Each batch row of a block is posted in
// `pieces` equal pieces of whole token rows.
struct PushLayout {
  int rank = 0;
  int n = 1;
  int batch = 1;
  int pieces = 1;
  size_t row_bytes = 0;  // one batch of one rank's K (or V) block

  // The rank k ahead of us (k = 1: the nearest, pushed first); we are the
  // rank k behind it, so our block is its slot k - 1.
  PK_HD int peer(int k) const { return (rank + k) % n; }
  // Bytes from one batch of a slot to the next.
  PK_HD size_t pitch() const { return size_t(n - 1) * row_bytes; }
  // Where V's half of a region starts.
  PK_HD size_t v_offset() const { return size_t(batch) * pitch(); }
  PK_HD size_t piece_bytes() const { return row_bytes / pieces; }
  // Offset of batch b of our K block in the region of peer(k).
  PK_HD size_t slot(int k, int b) const { return size_t(k - 1) * row_bytes + size_t(b) * pitch(); }
};

// How a peer's K (or V) block is cut into posted pieces: piece i holds rows
// [i, i + 1) * s_local / pieces of every K/V head (of every batch: the bytes
// PushLayout::piece_bytes() at i * piece_bytes() of each batch row).
struct PiecePlan {
  int pieces = 1;
  int s_local = 0;

  PK_HD int rows_per_piece() const { return s_local / pieces; }
  // The piece holding row `row`.
  PK_HD int piece_of(int row) const { return row / rows_per_piece(); }
  // Rows [r0, r1) that piece `i` holds.
  PK_HD void rows(int i, int& r0, int& r1) const {
    const int u1 = (i + 1) * rows_per_piece();
    r0 = i * rows_per_piece();
    r1 = u1 < s_local ? u1 : s_local;
  }
  PK_HD bool valid() const { return pieces >= 1 && s_local > 0 && s_local % pieces == 0; }
};

// One K/V tile of the walk.
struct KvTile {
  int step;    // 0: our own block; s >= 1: the block of rank (r - s) mod n
  int row;     // first row of the tile inside that rank's block
  int token;   // global token of that row
  int skip;    // leading keys of the tile that the tile before it covered
  bool masked; // skip > 0, or some key of the tile comes after some query of the tile
};

class KvWalk {
 public:
  // `q_first`: global token of the query tile's first row; `q_rows` its rows.
  PK_HD KvWalk(const Geometry& g, int q_first, int q_rows, int tile_k)
      : g_(g), q_first_(q_first), q_last_(q_first + q_rows - 1), tile_k_(tile_k),
        src_(g.rank) {}

  // The next tile, false after the last one. Incremental: the source rank
  // and the chunk's first token change only between chunks, so a tile
  // inside a chunk costs no division (the kernels call this once per K/V
  // tile, between one tile's GEMMs and the next).
  PK_HD bool next(KvTile& t) {
    while (step_ < g_.n) {
      if (count_ < 0) {
        start_ = g_.chunk_start(src_, chunk_);
        count_ = tiles_in_chunk(start_);
      }
      if (tile_ < count_) {
        const int rows = g_.chunk_rows();
        const int next_key = tile_ * tile_k_;  // the first key no earlier tile covered
        const int offset = next_key + tile_k_ <= rows ? next_key : rows - tile_k_;
        t.step = step_;
        t.row = chunk_ * rows + offset;
        t.token = start_ + offset;
        t.skip = next_key - offset;
        t.masked = t.skip > 0 || (g_.causal && t.token + tile_k_ - 1 > q_first_);
        ++tile_;
        return true;
      }
      tile_ = 0;
      count_ = -1;
      if (++chunk_ == g_.chunks()) {
        chunk_ = 0;
        ++step_;
        src_ = src_ == 0 ? g_.n - 1 : src_ - 1;  // rank - step, mod n
      }
    }
    return false;
  }

 private:
  // Tiles of the chunk starting at global token `start` whose first key no
  // earlier tile covered is at or before the query tile's last query.
  PK_HD int tiles_in_chunk(int start) const {
    const int all = (g_.chunk_rows() + tile_k_ - 1) / tile_k_;
    if (!g_.causal) return all;
    if (start > q_last_) return 0;
    const int visible = (q_last_ - start) / tile_k_ + 1;
    return visible < all ? visible : all;
  }

  Geometry g_;
  int q_first_, q_last_, tile_k_;
  int step_ = 0, chunk_ = 0, tile_ = 0, count_ = -1;
  int src_;        // the rank whose block step_ visits: (rank - step_) mod n
  int start_ = 0;  // global token of the current chunk's first row
};

}  // namespace pk::ring_attention
