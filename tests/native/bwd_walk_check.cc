// Host-side dump of the block backward's query-tile walk (bwd_walk.cuh) for
// one block pair: for every K/V tile, the global token of its first row and
// the (head, query tile, first query token, masked) tiles the walk visits,
// in order. tests/test_attention_bwd_walk_cpu.py compares them with the
// reference positions (pk_jax/reference.py: positions).
// Usage: bwd_walk_check n s_q s_kv zigzag causal group tile_q tile_kv q_rank k_rank
#include <cstdio>
#include <cstdlib>

#include "kernels/attention_bwd/bwd_walk.cuh"

using pk::attention_bwd::BwdArgs;
using pk::attention_bwd::BwdWalk;

int main(int argc, char** argv) {
  if (argc != 11)
    return std::printf("usage: n s_q s_kv zigzag causal group tile_q tile_kv q_rank k_rank\n"), 2;
  int v[10];
  for (int i = 0; i < 10; ++i) v[i] = std::atoi(argv[i + 1]);
  BwdArgs a;
  a.n = v[0];
  a.s_q = v[1];
  a.s_kv = v[2];
  a.zigzag = v[3] != 0;
  a.causal = v[4] != 0;
  a.group = v[5];
  const int tile_q = v[6], tile_kv = v[7], q_rank = v[8], k_rank = v[9];
  for (int t = 0; t < a.s_kv / tile_kv; ++t) {
    BwdWalk walk(a, q_rank, k_rank, t, tile_q, tile_kv);
    std::printf("kv %d %d", t, walk.k_first());
    int head, q_tile, q_first;
    bool masked;
    while (walk.next(head, q_tile, q_first, masked))
      std::printf(" %d,%d,%d,%d", head, q_tile, q_first, int(masked));
    std::printf("\n");
  }
  return 0;
}
