// Host-side dump of the fused ring backward's post indices
// (csrc/kernels/ring_attention_bwd/ring_attention_bwd.h: make_posts), the
// constants of tests/test_ring_attention_bwd_protocol_cpu.py's stream model:
// the model runs on exactly what the kernel's header computes. One line per
// ring size n = 2 .. kMaxRanks:
//   n count home kv[1..n-1] | partial[1..n-1] | credit[1..n-1]
#include <cstdio>
#include <initializer_list>

#include "kernels/ring_attention_bwd/ring_attention_bwd.h"

int main() {
  using pk::ring_attention_bwd::make_posts;
  for (int n = 2; n <= pk::kMaxRanks; ++n) {
    const auto p = make_posts(n);
    std::printf("%d %d %d", n, p.count, p.home);
    for (const int* a : {p.kv, p.partial, p.credit}) {
      std::printf(" |");
      for (int s = 1; s < n; ++s) std::printf(" %d", a[s]);
    }
    std::printf("\n");
  }
  return 0;
}
