// One tile configuration of the sm90 GEMM for tools/gemm_sweep (bf16 in, bf16
// out, B [k, n] row-major), picked by -DPK_SWEEP_INDEX=i: each configuration
// is its own translation unit, so they compile in parallel.
#include "kernels/gemm/gemm_sm90.cuh"

#ifndef PK_SWEEP_INDEX
#error "compile with -DPK_SWEEP_INDEX=<0..5>"
#endif

namespace {

using namespace cute;
using pk::gemm::Sm90Tiles;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PingPong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingPongEpi = cutlass::epilogue::TmaWarpSpecialized;

#if PK_SWEEP_INDEX == 0
constexpr const char* kName = "128x256x64 c2x1 coop (ops)";
using Tiles = pk::gemm::DefaultTiles;
#elif PK_SWEEP_INDEX == 1
constexpr const char* kName = "128x256x64 c1x2 coop";
using Tiles = Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>;
#elif PK_SWEEP_INDEX == 2
constexpr const char* kName = "256x128x64 c1x2 coop";
using Tiles = Sm90Tiles<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>;
#elif PK_SWEEP_INDEX == 3
constexpr const char* kName = "256x128x64 c2x1 coop";
using Tiles = Sm90Tiles<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>;
#elif PK_SWEEP_INDEX == 4
constexpr const char* kName = "128x128x64 c2x1 pingpong";
using Tiles = Sm90Tiles<Shape<_128, _128, _64>, Shape<_2, _1, _1>, PingPong, PingPongEpi>;
#elif PK_SWEEP_INDEX == 5
constexpr const char* kName = "128x256x64 c1x1 coop";
using Tiles = Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>;
#else
#error "PK_SWEEP_INDEX out of range"
#endif

using Gemm = pk::gemm::Sm90Gemm<cutlass::bfloat16_t, cutlass::bfloat16_t,
                                cutlass::layout::RowMajor, Tiles>;

}  // namespace

#define PK_CAT2(a, b) a##b
#define PK_CAT(a, b) PK_CAT2(a, b)

const char* PK_CAT(pk_sweep_name_, PK_SWEEP_INDEX)() { return kName; }

cudaError_t PK_CAT(pk_sweep_run_, PK_SWEEP_INDEX)(const pk::gemm::Problem& p,
                                                   const pk::gemm::Device& dev,
                                                   cudaStream_t stream, int swizzle) {
  return Gemm::run(p, dev, stream, swizzle);
}
