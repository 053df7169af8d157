// Host check of the ring attention kernels' 64-bit offsets (kv_walk.cuh:
// TensorStrides, PushLayout) at sizes where 32-bit products wrap.
// Usage: offsets_check n s_local batch q_heads kv_heads head_dim
// Prints one "name value" line per quantity (tests/test_kv_walk_cpu.py
// compares them with Python's exact integers), then "OK", or the first
// mismatch between where the pushes put a K/V element (PushLayout, bytes)
// and where the kernel's TMA reads it (TensorStrides of the peers' tensor
// [B, (n - 1) * s_local, Hkv, D]) (exit code 1).
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "kernels/ring_attention/kv_walk.cuh"

using pk::ring_attention::PushLayout;
using pk::ring_attention::TensorStrides;

int main(int argc, char** argv) {
  if (argc != 7) return 2;
  const int n = std::atoi(argv[1]), s_local = std::atoi(argv[2]), batch = std::atoi(argv[3]);
  const int hq = std::atoi(argv[4]), hkv = std::atoi(argv[5]), d = std::atoi(argv[6]);
  const int64_t elem = 2;  // bf16 / fp16

  const TensorStrides q = TensorStrides::of(s_local, hq, d);
  const TensorStrides peers = TensorStrides::of(int64_t(n - 1) * s_local, hkv, d);
  std::printf("q_row %" PRId64 "\nq_head %" PRId64 "\nq_batch %" PRId64 "\n", q.row, q.head,
              q.batch);
  std::printf("peers_batch %" PRId64 "\n", peers.batch);
  // The last element of q: every mode at its end.
  std::printf("q_last %" PRId64 "\n",
              int64_t(batch - 1) * q.batch + int64_t(s_local - 1) * q.row +
                  int64_t(hq - 1) * q.head + (d - 1));

  const size_t row_bytes = size_t(s_local) * size_t(hkv) * size_t(d) * size_t(elem);
  for (int r = 0; r < n; ++r) {
    const PushLayout L{r, n, batch, 1, row_bytes};
    if (r == 0)
      std::printf("pitch %zu\nv_offset %zu\nlast_slot %zu\n", L.pitch(), L.v_offset(),
                  L.slot(n - 1, batch - 1));
    for (int k = 1; k < n; ++k) {
      for (int b : {0, batch - 1}) {
        for (int t : {0, s_local - 1}) {
          for (int h : {0, hkv - 1}) {
            const uint64_t pushed = L.slot(k, b) + uint64_t(t) * hkv * d * elem +
                                    uint64_t(h) * d * elem;
            const int64_t read = (int64_t(b) * peers.batch +
                                  (int64_t(k - 1) * s_local + t) * peers.row +
                                  int64_t(h) * peers.head) *
                                 elem;
            if (read < 0 || uint64_t(read) != pushed) {
              std::printf("FAIL rank %d slot %d batch %d token %d head %d: pushed at %" PRIu64
                          ", read at %" PRId64 "\n",
                          r, k, b, t, h, pushed, read);
              return 1;
            }
          }
        }
      }
    }
  }
  std::printf("OK\n");
  return 0;
}
