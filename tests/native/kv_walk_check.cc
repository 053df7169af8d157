// Host-side check of the ring attention kernel's K/V walk (kv_walk.cuh):
// for every geometry given on the command line it walks every query tile and
// checks that the walk visits exactly the K/V tiles holding a key some query
// of the tile may see, each once, in the order the posting protocol assumes,
// and that every tile it leaves unmasked is wholly visible. It also checks
// every piece plan of the block (PiecePlan, by rows and by heads, 1-8 pieces,
// several K/V head counts): the rows each piece copies are exactly the units
// piece_of() assigns to it, and every unit is copied once.
// Usage: kv_walk_check n s_local zigzag causal tile_q tile_k
// Prints the global token of every row of every rank's block, then "OK", or
// the first violation (exit code 1).
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>

#include "kernels/ring_attention/kv_walk.cuh"

using pk::ring_attention::Geometry;
using pk::ring_attention::KvTile;
using pk::ring_attention::KvWalk;
using pk::ring_attention::PiecePlan;

namespace {

int fail(const char* what, int rank, int m, int step, int row) {
  std::printf("FAIL %s: rank %d query tile %d step %d row %d\n", what, rank, m, step, row);
  return 1;
}

// 0 when the plan's copies (first_head/last_head/rows) and its waits
// (piece_of) agree and cover every unit once.
int check_plan(const PiecePlan& plan) {
  std::vector<int> copies(size_t(plan.kv_heads) * plan.s_local, 0);
  for (int i = 0; i < plan.pieces; ++i) {
    for (int h = plan.first_head(i); h <= plan.last_head(i); ++h) {
      int r0, r1;
      plan.rows(i, h, r0, r1);
      if (r0 >= r1) return std::printf("FAIL plan: piece %d copies no row of head %d\n", i, h), 1;
      for (int r = r0; r < r1; ++r) {
        if (plan.piece_of(h, r) != i)
          return std::printf("FAIL plan: head %d row %d copied by piece %d, waited as %d\n", h, r,
                             i, plan.piece_of(h, r)), 1;
        ++copies[size_t(h) * plan.s_local + r];
      }
    }
  }
  for (size_t u = 0; u < copies.size(); ++u)
    if (copies[u] != 1)
      return std::printf("FAIL plan: head %zu row %zu copied %d times\n", u / plan.s_local,
                         u % plan.s_local, copies[u]), 1;
  return 0;
}

int check_plans(int s_local) {
  for (int kv_heads : {1, 2, 3, 4, 12, 16})
    for (int pieces = 1; pieces <= 8; ++pieces)
      for (bool by_heads : {false, true}) {
        const PiecePlan plan{pieces, by_heads, kv_heads, s_local};
        if (!plan.valid()) continue;
        if (check_plan(plan)) {
          std::printf("  (kv_heads %d, pieces %d, by_heads %d)\n", kv_heads, pieces, by_heads);
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
      std::set<std::pair<int, int>> seen;
      KvWalk walk(g, q_first, tile_q, tile_k);
      KvTile t;
      int last_step = 0, last_row = -1;
      while (walk.next(t)) {
        if (!seen.insert({t.step, t.row}).second) return fail("visited twice", rank, m, t.step, t.row);
        if (t.step < last_step || (t.step == last_step && t.row <= last_row))
          return fail("out of order", rank, m, t.step, t.row);
        last_step = t.step, last_row = t.row;
        const int src = (rank - t.step + n) % n;
        if (g.token(src, t.row) != t.token) return fail("wrong token", rank, m, t.step, t.row);
        bool all_visible = true, any_visible = false;
        for (int j = 0; j < tile_k; ++j) {
          const int k = g.token(src, t.row + j);
          all_visible &= !causal || k <= q_first;
          any_visible |= !causal || k <= q_last;
        }
        if (!any_visible) return fail("wholly masked tile visited", rank, m, t.step, t.row);
        if (!all_visible && !t.masked) return fail("mask missing", rank, m, t.step, t.row);
      }
      // Every tile with a visible key must have been visited.
      for (int step = 0; step < n; ++step) {
        const int src = (rank - step + n) % n;
        for (int row = 0; row < s_local; row += tile_k) {
          bool any_visible = false;
          for (int j = 0; j < tile_k; ++j) any_visible |= !causal || g.token(src, row + j) <= q_last;
          if (any_visible && !seen.count({step, row})) return fail("tile skipped", rank, m, step, row);
        }
      }
      if (seen.empty()) return fail("empty walk", rank, m, 0, 0);
    }
  }
  if (check_plans(s_local)) return 1;
  std::printf("OK\n");
  return 0;
}
