// One tile configuration of the sm90 GEMM for tools/gemm_sweep (bf16 in, bf16
// out, B [k, n] row-major), picked by -DPK_SWEEP_INDEX=i: each configuration
// is its own translation unit, so they compile in parallel.
#include <iterator>
#include <tuple>

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

// The sweep's configurations, in the order main.cu numbers them.
using Configs = std::tuple<
    pk::gemm::DefaultTiles,
    Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>,
    Sm90Tiles<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>,
    Sm90Tiles<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>,
    Sm90Tiles<Shape<_128, _128, _64>, Shape<_2, _1, _1>, PingPong, PingPongEpi>,
    Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>>;
constexpr const char* kNames[] = {"128x256x64 c2x1 coop (ops)", "128x256x64 c1x2 coop",
                                  "256x128x64 c1x2 coop",       "256x128x64 c2x1 coop",
                                  "128x128x64 c2x1 pingpong",   "128x256x64 c1x1 coop"};
static_assert(std::tuple_size_v<Configs> == std::size(kNames));
static_assert(PK_SWEEP_INDEX >= 0 && PK_SWEEP_INDEX < std::tuple_size_v<Configs>,
              "PK_SWEEP_INDEX out of range");
using Tiles = std::tuple_element_t<PK_SWEEP_INDEX, Configs>;
constexpr const char* kName = kNames[PK_SWEEP_INDEX];

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
