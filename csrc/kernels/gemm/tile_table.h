// Which tile configuration (gemm.h: Tiles) a 16-bit GEMM runs, from the
// measured table below: tools/sweep.sh gemm_sweep on one H200 at the TP ops' chunk
// shapes (rows per chunk = tokens / ranks; Llama-3 8B and 70B at TP 2-8),
// the ops' 128x256 cooperative tiles (kWide) against 128x128 ping-pong tiles
// (kNarrow), ms with the default swizzle (benchmarks/NOTES.md, 2026-12-04,
// "GEMM tiles at the TP ops' chunk shapes"):
//
//   M x N x K           wide tiles   kWide   kNarrow
//   1024 x 1792 x 4096       56      0.058   0.030
//   1024 x 3584 x 8192      112      0.083   0.088
//   1024 x 4096 x 1792      128      0.023   0.023
//   1024 x 8192 x 3584      256      0.083   0.086
//   2048 x 7168 x 8192      448      0.354   0.325
//   2048 x 8192 x 7168      512      0.354   0.366
//   4096 x 7168 x 4096      896      0.350   0.352
//   4096 x 4096 x 7168      512      0.345   0.371
//
// A grid of at most 64 wide tiles (under half of the H200's 132 SMs) runs
// kNarrow: twice the CTAs, each warpgroup's epilogue under the other's
// mainloop. Above, the wide tiles lead or tie except at 2048 x 7168 x 8192
// (kNarrow 9% faster; 2048 x 14336 x 4096, 896 wide tiles, 7% in the
// 2026-12-03 sweep), while 2048 x 8192 x 7168 loses 3% with kNarrow: no rule
// by tile count separates them, so they stay on kWide. Forward layout only
// (A and B row-major, output in the input type): the backward layouts keep
// kWide.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm.h"

namespace pk::gemm {

constexpr int64_t kNarrowMaxWideTiles = 64;

inline Tiles tiles_for(const Problem& p) {
  if (p.a_transposed || p.b_transposed || p.out != p.in || is_fp8(p.in)) return Tiles::kWide;
  const int64_t wide_tiles = ((p.m + 127) / 128) * ((p.n + 255) / 256);
  return wide_tiles <= kNarrowMaxWideTiles ? Tiles::kNarrow : Tiles::kWide;
}

}  // namespace pk::gemm
