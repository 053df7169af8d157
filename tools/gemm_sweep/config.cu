// One configuration of the sm90 GEMMs for tools/gemm_sweep, picked by
// -DPK_SWEEP_INDEX=i: each configuration is its own translation unit, so they
// compile in parallel. Kinds (main.cu prepares the operands of each):
//   0 bf16: A [m, k], B [k, n] row-major, bf16 out;
//   1 fp8 tensor: A [m, k], B [n, k] e4m3, one factor each, bf16 out;
//   2 fp8 block: the same with 1x128 / 128x128 factors;
//   3 fp8 dgrad: A e5m2, B e4m3, one factor each (the input gradient's
//     operands: dy and w), promotion to fp32 registers every 128 of K;
//   4 fp8 wgrad: A e4m3, B e5m2 (x^T and dy^T), likewise.
#include <iterator>
#include <tuple>

#include "kernels/gemm/gemm_fp8_sm90.cuh"

#ifndef PK_SWEEP_INDEX
#error "compile with -DPK_SWEEP_INDEX=<0..30>"
#endif

namespace {

using namespace cute;
using pk::gemm::Sm90Tiles;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PingPong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingPongEpi = cutlass::epilogue::TmaWarpSpecialized;
using Fast = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
using FastPingPong = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
using Block = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
using BlockPingPong = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
using StreamK = cutlass::gemm::StreamKScheduler;
using BF16 = cutlass::bfloat16_t;
using E4M3 = cutlass::float_e4m3_t;
using E5M2 = cutlass::float_e5m2_t;
using Row = cutlass::layout::RowMajor;

template <class Tiles>
using Bf16 = pk::gemm::Sm90Gemm<BF16, BF16, Row, Tiles>;
template <class Tiles>
using Fp8Tensor = pk::gemm::Sm90Fp8TensorGemm<E4M3, E4M3, BF16, Tiles>;
template <class Tiles>
using Dgrad = pk::gemm::Sm90Fp8TensorGemm<E5M2, E4M3, BF16, Tiles>;
template <class Tiles>
using Wgrad = pk::gemm::Sm90Fp8TensorGemm<E4M3, E5M2, BF16, Tiles>;
template <class Tiles>
using Fp8Block = pk::gemm::Sm90Fp8BlockGemm<E4M3, E4M3, BF16, false, Tiles>;

// kInterval: the promoted FP8 mainloop's promotion interval in wgmma K-steps
// of 32 (0: the kernel's own, 4 = every 128 of K).
template <class G, int kKind, int kInterval = 0>
struct Entry {
  using Gemm = G;
  static constexpr int kind = kKind;
  static constexpr int interval = kInterval;
};

// The sweep's configurations, in the order main.cu numbers them.
using Configs = std::tuple<
    Entry<Bf16<pk::gemm::DefaultTiles>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>>, 0>,
    Entry<Bf16<pk::gemm::NarrowTiles>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_128, _256, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, StreamK>>, 0>,
    Entry<Bf16<Sm90Tiles<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, StreamK>>, 0>,
    Entry<Fp8Tensor<pk::gemm::Fp8TensorTiles<Fast>>, 1>,
    Entry<Fp8Tensor<Sm90Tiles<Shape<_128, _256, _128>, Shape<_1, _2, _1>, Fast, CoopEpi>>, 1>,
    Entry<Fp8Tensor<Sm90Tiles<Shape<_256, _128, _128>, Shape<_1, _2, _1>, Fast, CoopEpi>>, 1>,
    Entry<Fp8Tensor<Sm90Tiles<Shape<_128, _128, _128>, Shape<_1, _2, _1>, FastPingPong,
                              PingPongEpi>>, 1>,
    Entry<Fp8Tensor<Sm90Tiles<Shape<_128, _256, _128>, Shape<_2, _1, _1>, Fast, CoopEpi,
                              StreamK>>, 1>,
    Entry<Fp8Block<pk::gemm::Fp8BlockTiles>, 2>,
    Entry<Fp8Block<Sm90Tiles<Shape<_128, _128, _128>, Shape<_2, _1, _1>, Block, CoopEpi>>, 2>,
    Entry<Fp8Block<Sm90Tiles<Shape<_64, _128, _128>, Shape<_1, _2, _1>, BlockPingPong,
                             PingPongEpi>>, 2>,
    // (128x192 bf16 tiles measured 0.85-0.95x pk's: benchmarks/NOTES.md, 2026-12-03.)
    Entry<Fp8Tensor<Sm90Tiles<Shape<_256, _128, _128>, Shape<_2, _1, _1>, Fast, CoopEpi>>, 1>,
    Entry<Dgrad<pk::gemm::Fp8PromotedTiles>, 3>,
    Entry<Dgrad<Sm90Tiles<Shape<_128, _256, _128>, Shape<_2, _1, _1>, Coop, CoopEpi>>, 3>,
    Entry<Dgrad<Sm90Tiles<Shape<_128, _192, _128>, Shape<_1, _2, _1>, Coop, CoopEpi>>, 3>,
    Entry<Dgrad<Sm90Tiles<Shape<_128, _128, _128>, Shape<_1, _2, _1>, Coop, CoopEpi>>, 3>,
    Entry<Dgrad<Sm90Tiles<Shape<_128, _256, _128>, Shape<_2, _1, _1>, Fast, CoopEpi>>, 3>,
    Entry<Wgrad<pk::gemm::Fp8PromotedTiles>, 4>,
    Entry<Wgrad<Sm90Tiles<Shape<_128, _256, _128>, Shape<_2, _1, _1>, Coop, CoopEpi>>, 4>,
    Entry<Wgrad<Sm90Tiles<Shape<_128, _192, _128>, Shape<_1, _2, _1>, Coop, CoopEpi>>, 4>,
    Entry<Dgrad<pk::gemm::Fp8PromotedTiles>, 3, 8>,
    Entry<Dgrad<Sm90Tiles<Shape<_64, _192, _128>, Shape<_2, _1, _1>, PingPong, PingPongEpi>>, 3>,
    Entry<Wgrad<pk::gemm::Fp8PromotedTiles>, 4, 8>,
    Entry<Wgrad<Sm90Tiles<Shape<_64, _192, _128>, Shape<_2, _1, _1>, PingPong, PingPongEpi>>, 4>,
    Entry<Dgrad<Sm90Tiles<Shape<_64, _192, _128>, Shape<_2, _1, _1>, PingPong, PingPongEpi>>, 3, 8>,
    Entry<Wgrad<Sm90Tiles<Shape<_64, _192, _128>, Shape<_2, _1, _1>, PingPong, PingPongEpi>>, 4, 8>>;
constexpr const char* kNames[] = {
    "bf16 128x256x64 c2x1 coop (ops)", "bf16 128x256x64 c1x2 coop",
    "bf16 256x128x64 c1x2 coop",       "bf16 256x128x64 c2x1 coop",
    "bf16 128x128x64 c2x1 pingpong (ops, few tiles)", "bf16 128x256x64 c1x1 coop",
    "bf16 128x256x64 c2x1 coop streamk", "bf16 256x128x64 c2x1 coop streamk",
    "fp8 tensor 128x256x128 c2x1 coop fast (ops)", "fp8 tensor 128x256x128 c1x2 coop fast",
    "fp8 tensor 256x128x128 c1x2 coop fast", "fp8 tensor 128x128x128 c1x2 pingpong fast",
    "fp8 tensor 128x256x128 c2x1 coop fast streamk",
    "fp8 block 128x128x128 c1x2 coop (ops)", "fp8 block 128x128x128 c2x1 coop",
    "fp8 block 64x128x128 c1x2 pingpong", "fp8 tensor 256x128x128 c2x1 coop fast",
    "dgrad 128x192x128 c2x1 coop promoted (ops)", "dgrad 128x256x128 c2x1 coop promoted",
    "dgrad 128x192x128 c1x2 coop promoted", "dgrad 128x128x128 c1x2 coop promoted",
    "dgrad 128x256x128 c2x1 coop fast (no promotion)",
    "wgrad 128x192x128 c2x1 coop promoted (ops)", "wgrad 128x256x128 c2x1 coop promoted",
    "wgrad 128x192x128 c1x2 coop promoted",
    "dgrad 128x192x128 c2x1 coop promoted every 256 of K",
    "dgrad 64x192x128 c2x1 pingpong promoted",
    "wgrad 128x192x128 c2x1 coop promoted every 256 of K",
    "wgrad 64x192x128 c2x1 pingpong promoted",
    "dgrad 64x192x128 c2x1 pingpong promoted every 256 of K",
    "wgrad 64x192x128 c2x1 pingpong promoted every 256 of K"};
static_assert(std::tuple_size_v<Configs> == std::size(kNames));
static_assert(PK_SWEEP_INDEX >= 0 && PK_SWEEP_INDEX < std::tuple_size_v<Configs>,
              "PK_SWEEP_INDEX out of range");
using This = std::tuple_element_t<PK_SWEEP_INDEX, Configs>;

template <class E>
cudaError_t run_entry(const pk::gemm::Problem& p, const pk::gemm::Device& dev,
                      cudaStream_t stream, int swizzle) {
  using Gemm = typename E::Gemm;
  if constexpr (E::kind == 0) {
    return Gemm::run(p, dev, stream, swizzle);
  } else {
    auto args = Gemm::arguments(p, dev, swizzle);
    if constexpr (E::interval > 0) args.mainloop.mma_promotion_interval = E::interval;
    return pk::gemm::launch<typename Gemm::Adapter>(args, dev, stream);
  }
}

}  // namespace

#define PK_CAT2(a, b) a##b
#define PK_CAT(a, b) PK_CAT2(a, b)

const char* PK_CAT(pk_sweep_name_, PK_SWEEP_INDEX)() { return kNames[PK_SWEEP_INDEX]; }
int PK_CAT(pk_sweep_kind_, PK_SWEEP_INDEX)() { return This::kind; }

cudaError_t PK_CAT(pk_sweep_run_, PK_SWEEP_INDEX)(const pk::gemm::Problem& p,
                                                   const pk::gemm::Device& dev,
                                                   cudaStream_t stream, int swizzle) {
  return run_entry<This>(p, dev, stream, swizzle);
}
