// Host-side check of the ring attention kernel's K/V walk (kv_walk.cuh):
// for every geometry given on the command line it walks every query tile and
// checks that the walk covers every key some query of the tile may see exactly
// once (a tile's leading `skip` keys, masked, belong to the tile before it),
// in the order the posting protocol assumes, that no tile reads past its chunk
// and that every tile it leaves unmasked is wholly visible. Then the push
// layout (PushLayout, shared by both mechanisms' pushes): every rank's block
// lands, batch by batch and piece by piece, exactly where the receiving
// rank's walk reads it at the matching ring step, in the piece the walk
// waits for (PiecePlan::piece_of), and the senders' slots tile each region
// once. Last, every piece plan of the block (PiecePlan, 1-8 pieces): the rows
// each piece copies are exactly the rows piece_of() assigns to it, and every
// row is copied once.
// Usage: kv_walk_check n s_local zigzag causal tile_q tile_k
// Prints the global token of every row of every rank's block, then "OK", or
// the first violation (exit code 1).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/ring_attention/kv_walk.cuh"

using pk::ring_attention::Geometry;
using pk::ring_attention::KvTile;
using pk::ring_attention::KvWalk;
using pk::ring_attention::PushLayout;
using pk::ring_attention::PiecePlan;

namespace {

int fail(const char* what, int rank, int m, int step, int row) {
  std::printf("FAIL %s: rank %d query tile %d step %d row %d\n", what, rank, m, step, row);
  return 1;
}

// The push layout for a ring of n, s_local rows of `row` bytes per batch
// row, `batch` batches, posted in `pieces`.
int check_push(int n, int s_local, int batch, int pieces) {
  const size_t row = 256;  // bytes of one token row (e.g. one K/V head of 128 x bf16)
  const size_t row_bytes = size_t(s_local) * row;
  const int piece_rows = s_local / pieces;
  const PiecePlan plan{pieces, s_local};
  for (int q = 0; q < n; ++q) {  // the receiving rank
    // How often every token row of q's region (K half, then V half) is written.
    std::vector<int> hits(2 * size_t(batch) * (n - 1) * s_local, 0);
    for (int r = 0; r < n; ++r) {  // the sending rank
      if (r == q) continue;
      const PushLayout L{r, n, batch, pieces, row_bytes};
      if (L.v_offset() != size_t(n - 1) * batch * row_bytes) return fail("v offset", r, 0, 0, 0);
      if (L.piece_bytes() * pieces != row_bytes) return fail("pieces", r, 0, 0, 0);
      int k = 1;
      while (L.peer(k) != q) ++k;
      // q's walk reads r's block at step s with (q - s) mod n == r, from
      // the peers' tensor [B, (n - 1) * s_local] at rows (s - 1) * s_local + t.
      const int s = (q - r + n) % n;
      if (k != s) return fail("slot is not the reader's step", r, q, s, k);
      for (int b = 0; b < batch; ++b)
        for (int i = 0; i < pieces; ++i)
          for (int t = i * piece_rows; t < (i + 1) * piece_rows; ++t) {
            // The pusher's byte offset of row t (piece i, batch b), in q's region.
            const size_t at = L.slot(k, b) + size_t(i) * L.piece_bytes() +
                              size_t(t - i * piece_rows) * row;
            const size_t want = (size_t(b) * (n - 1) * s_local + size_t(s - 1) * s_local + t) * row;
            if (at != want) return fail("pushed row misplaced", r, q, s, t);
            if (plan.piece_of(t) != i) return fail("row in the wrong piece", r, q, s, t);
            ++hits[at / row];
            ++hits[(L.v_offset() + at) / row];
          }
    }
    for (size_t j = 0; j < hits.size(); ++j)
      if (hits[j] != 1) return fail("region row not written exactly once", q, 0, 0, int(j));
  }
  return 0;
}

// 0 when the plan's copies (rows) and its waits (piece_of) agree and cover
// every row once.
int check_plan(const PiecePlan& plan) {
  std::vector<int> copies(size_t(plan.s_local), 0);
  for (int i = 0; i < plan.pieces; ++i) {
    int r0, r1;
    plan.rows(i, r0, r1);
    if (r0 >= r1) return std::printf("FAIL plan: piece %d copies no row\n", i), 1;
    for (int r = r0; r < r1; ++r) {
      if (plan.piece_of(r) != i)
        return std::printf("FAIL plan: row %d copied by piece %d, waited as %d\n", r, i,
                           plan.piece_of(r)), 1;
      ++copies[size_t(r)];
    }
  }
  for (size_t r = 0; r < copies.size(); ++r)
    if (copies[r] != 1)
      return std::printf("FAIL plan: row %zu copied %d times\n", r, copies[r]), 1;
  return 0;
}

int check_plans(int s_local) {
  for (int pieces = 1; pieces <= 8; ++pieces) {
    const PiecePlan plan{pieces, s_local};
    if (!plan.valid()) continue;
    if (check_plan(plan)) {
      std::printf("  (pieces %d)\n", pieces);
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) return std::printf("usage: n s_local zigzag causal tile_q tile_k\n"), 2;
  const int n = std::atoi(argv[1]), s_local = std::atoi(argv[2]), tile_q = std::atoi(argv[5]),
            tile_k = std::atoi(argv[6]);
  const bool zigzag = std::atoi(argv[3]) != 0, causal = std::atoi(argv[4]) != 0;
  for (int rank = 0; rank < n; ++rank) {
    const Geometry g{rank, n, s_local, zigzag, causal};
    std::printf("tokens %d", rank);
    for (int j = 0; j < s_local; ++j) std::printf(" %d", g.token(rank, j));
    std::printf("\n");
    for (int m = 0; m < s_local / tile_q; ++m) {
      const int q_first = g.token(rank, m * tile_q);
      for (int i = 0; i < tile_q; ++i)  // a query tile is consecutive tokens
        if (g.token(rank, m * tile_q + i) != q_first + i) return fail("tile straddles", rank, m, 0, i);
      const int q_last = q_first + tile_q - 1;
      // How often the walk covered each key of each step's block (a tile's
      // first `skip` keys are not its own: the tile before it covered them).
      std::vector<std::vector<int>> covered(n, std::vector<int>(s_local, 0));
      const int chunk_rows = g.chunk_rows();
      KvWalk walk(g, q_first, tile_q, tile_k);
      KvTile t;
      int last_step = 0, last_row = -1, tiles = 0;
      while (walk.next(t)) {
        ++tiles;
        if (t.step < last_step || (t.step == last_step && t.row <= last_row))
          return fail("out of order", rank, m, t.step, t.row);
        last_step = t.step, last_row = t.row;
        if (t.skip < 0 || t.skip >= tile_k) return fail("skip out of range", rank, m, t.step, t.row);
        if (t.row / chunk_rows != (t.row + tile_k - 1) / chunk_rows)
          return fail("tile reads past its chunk", rank, m, t.step, t.row);
        if (t.skip > 0 && !t.masked) return fail("covered keys unmasked", rank, m, t.step, t.row);
        const int src = (rank - t.step + n) % n;
        if (g.token(src, t.row) != t.token) return fail("wrong token", rank, m, t.step, t.row);
        bool all_visible = true, any_visible = false;
        for (int j = t.skip; j < tile_k; ++j) {
          const int k = g.token(src, t.row + j);
          all_visible &= !causal || k <= q_first;
          any_visible |= !causal || k <= q_last;
          ++covered[t.step][t.row + j];
        }
        if (!any_visible) return fail("wholly masked tile visited", rank, m, t.step, t.row);
        if (!all_visible && !t.masked) return fail("mask missing", rank, m, t.step, t.row);
      }
      // Every key some query of the tile sees is covered once; no key twice.
      for (int step = 0; step < n; ++step) {
        const int src = (rank - step + n) % n;
        for (int row = 0; row < s_local; ++row) {
          const bool visible = !causal || g.token(src, row) <= q_last;
          if (covered[step][row] > 1) return fail("key covered twice", rank, m, step, row);
          if (visible && covered[step][row] == 0) return fail("key skipped", rank, m, step, row);
        }
      }
      if (tiles == 0) return fail("empty walk", rank, m, 0, 0);
    }
  }
  for (int batch = 1; batch <= 3; ++batch)
    for (int pieces = 1; pieces <= 8; ++pieces)
      if (s_local % pieces == 0)
        if (int err = check_push(n, s_local, batch, pieces)) return err;
  if (check_plans(s_local)) return 1;
  std::printf("OK\n");
  return 0;
}
