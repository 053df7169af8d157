// The sm90 FP8 GEMMs (gemm.h: Scaling): CUTLASS's TMA warp-specialized
// cooperative kernels on FP8 wgmma with the persistent tile scheduler,
// instantiated once per (A type, B type, output type, scaling, B's block
// shape) in gemm_fp8_*.cu (gemm.h: Fp8Variant).
//
//   kTensor: D = sa sb (A @ B) + C in the epilogue (the factors read from
//     device memory, so a call needs no host sync and replays from a CUDA
//     graph). e4m3 x e4m3 accumulates in the tensor cores' own precision
//     (fast accumulation, Transformer Engine's choice for the forward);
//     products with an e5m2 operand (the gradients) promote the partial sums
//     to fp32 registers every 4 K-steps.
//   kBlock: the mainloop multiplies each 128-deep K-slab's partial sums by
//     its factors (A per row, B per 128 columns or per column) and adds them
//     to fp32 registers (DeepSeek-V3's promotion: Hopper's FP8 accumulators
//     keep about 14 bits); the epilogue adds C.
//
// Launch config: CUTLASS's (persistent grid of at most one CTA per SM,
// clusters of two). Arguments: gemm.h's Problem. Roles: one producer
// warpgroup (TMA loads of A, B and, for kBlock, the factors), two consumer
// warpgroups (wgmma, promotion, epilogue). Entry point: Fp8Variant<...>::launch.
#pragma once

#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/thread/activation.h>

#include "kernels/gemm/gemm_sm90.cuh"

namespace pk::gemm {

// 128x256 output tiles, 128-deep K steps (128 bytes of FP8), 2x1 clusters.
template <class KernelSchedule>
using Fp8TensorTiles = Sm90Tiles<cute::Shape<cute::_128, cute::_256, cute::_128>,
                                 cute::Shape<cute::_2, cute::_1, cute::_1>, KernelSchedule,
                                 cutlass::epilogue::TmaWarpSpecializedCooperative>;
// Products with an e5m2 operand promote: the wgmma accumulators of each
// 128-deep K step are added to a second set of fp32 registers, so a consumer
// warpgroup holds two copies of its accumulator tile. 64x192 per warpgroup
// (96 + 96 registers a thread) fits without spills; the 64x256 of
// Fp8TensorTiles (128 + 128) spilled about 900 bytes a thread and ran the
// gradient GEMMs at 0.28-0.38x the forward's; 128x192 with 2x1 clusters runs
// them at 0.83-1.00x, 1x2 clusters at 0.70-0.91x (benchmarks/NOTES.md,
// tools/gemm_sweep).
using Fp8PromotedTiles = Sm90Tiles<cute::Shape<cute::_128, cute::_192, cute::_128>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>,
                                   cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                   cutlass::epilogue::TmaWarpSpecializedCooperative>;
// 128x128 tiles: one B factor per tile column with 128x128 weight blocks.
using Fp8BlockTiles = Sm90Tiles<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                cute::Shape<cute::_1, cute::_2, cute::_1>,
                                cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                                cutlass::epilogue::TmaWarpSpecializedCooperative>;

template <typename A, typename B>
constexpr bool kFastAccum =
    std::is_same_v<A, cutlass::float_e4m3_t> && std::is_same_v<B, cutlass::float_e4m3_t>;

template <typename A, typename B, typename Out, class Tiles, class Fusion, class MainloopLayoutA,
          class MainloopLayoutB>
struct Sm90Fp8Kernel {
  using TileShape = typename Tiles::TileShape;
  using ClusterShape = typename Tiles::ClusterShape;
  static constexpr int kAlignOut = 16 / sizeof(Out);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out,
      cutlass::layout::RowMajor, kAlignOut, Out, cutlass::layout::RowMajor, kAlignOut,
      typename Tiles::EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, A, MainloopLayoutA, 16, B,
      MainloopLayoutB, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, typename Tiles::Scheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
};

// Per-tensor factors: the epilogue's scale_a * scale_b * acc + beta * C;
// e4m3 x e4m3 on Fp8TensorTiles with fast accumulation, the rest promoted on
// Fp8PromotedTiles.
template <typename A, typename B>
using Fp8TensorTilesOf =
    std::conditional_t<kFastAccum<A, B>,
                       Fp8TensorTiles<cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>,
                       Fp8PromotedTiles>;

template <typename A, typename B, typename Out, class Tiles = Fp8TensorTilesOf<A, B>>
struct Sm90Fp8TensorGemm {
  using Fusion = cutlass::epilogue::fusion::ScaledLinCombPerRowBiasEltAct<
      cutlass::epilogue::thread::Identity, Out, float, Out, Out, float>;
  using K = Sm90Fp8Kernel<A, B, Out, Tiles, Fusion, cutlass::layout::RowMajor,
                          cutlass::layout::ColumnMajor>;
  using Adapter = typename K::Adapter;

  static typename Adapter::Arguments arguments(const Problem& p, const Device& dev,
                                               int swizzle = 1) {
    const int m = int(p.m), n = int(p.n), k = int(p.k);
    auto* d = static_cast<Out*>(p.d);
    auto* c = p.c ? static_cast<const Out*>(p.c) : d;  // beta = 0: C is not read
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const A*>(p.a), cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1}),
         static_cast<const B*>(p.b), cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1})},
        {{}, c, cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1}), d,
         cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1})},
        cutlass::KernelHardwareInfo{dev.ordinal, dev.sm_count}};
    auto& f = args.epilogue.thread;
    f.alpha = 1.0f;
    f.beta = p.c ? 1.0f : 0.0f;
    f.scale_a_ptr = p.scale_a;
    f.scale_b_ptr = p.scale_b;
    f.bias_ptr = nullptr;
    args.scheduler.max_swizzle_size = swizzle;
    return args;
  }
};

// Block factors (DeepSeek-V3): A per 1x128, B per 128x128 or (kBRowBlocks) 1x128.
template <typename A, typename B, typename Out, bool kBRowBlocks, class Tiles = Fp8BlockTiles>
struct Sm90Fp8BlockGemm {
  // Granularity (M, N, K) of one factor; both stored MN-major (M or N
  // contiguous): A's as [k / 128, m], B's as [k / 128, n / 128] (or [k / 128, n]).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBRowBlocks ? 1 : kBlockK, kBlockK>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Fusion = cutlass::epilogue::fusion::LinearCombination<Out, float, Out, float>;
  using K = Sm90Fp8Kernel<A, B, Out, Tiles, Fusion,
                          cute::tuple<cutlass::layout::RowMajor, LayoutSFA>,
                          cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>>;
  using Adapter = typename K::Adapter;

  static typename Adapter::Arguments arguments(const Problem& p, const Device& dev,
                                               int swizzle = 1) {
    const int m = int(p.m), n = int(p.n), k = int(p.k);
    auto* d = static_cast<Out*>(p.d);
    auto* c = p.c ? static_cast<const Out*>(p.c) : d;
    const auto shape = cute::make_shape(m, n, k, 1);
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const A*>(p.a), cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1}),
         static_cast<const B*>(p.b), cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1}),
         p.scale_a, ScaleConfig::tile_atom_to_shape_SFA(shape), p.scale_b,
         ScaleConfig::tile_atom_to_shape_SFB(shape)},
        {{1.0f, p.c ? 1.0f : 0.0f}, c,
         cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1}), d,
         cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1})},
        cutlass::KernelHardwareInfo{dev.ordinal, dev.sm_count}};
    args.scheduler.max_swizzle_size = swizzle;
    return args;
  }
};

template <DType kA, DType kB, DType kOut, Scaling kScaling, bool kBRowBlocks>
using VariantFp8Gemm = std::conditional_t<
    kScaling == Scaling::kBlock,
    Sm90Fp8BlockGemm<typename CutlassType<kA>::Type, typename CutlassType<kB>::Type,
                     typename CutlassType<kOut>::Type, kBRowBlocks>,
    Sm90Fp8TensorGemm<typename CutlassType<kA>::Type, typename CutlassType<kB>::Type,
                      typename CutlassType<kOut>::Type>>;

template <DType kA, DType kB, DType kOut, Scaling kScaling, bool kBRowBlocks>
cudaError_t Fp8Variant<kA, kB, kOut, kScaling, kBRowBlocks>::check(const Problem& p,
                                                                   const Device& dev) {
  using G = VariantFp8Gemm<kA, kB, kOut, kScaling, kBRowBlocks>;
  return pk::gemm::check<typename G::Adapter>(G::arguments(p, dev), dev);
}

template <DType kA, DType kB, DType kOut, Scaling kScaling, bool kBRowBlocks>
cudaError_t Fp8Variant<kA, kB, kOut, kScaling, kBRowBlocks>::launch(const Problem& p,
                                                                    const Device& dev,
                                                                    cudaStream_t stream) {
  using G = VariantFp8Gemm<kA, kB, kOut, kScaling, kBRowBlocks>;
  return pk::gemm::launch<typename G::Adapter>(G::arguments(p, dev), dev, stream);
}

template <DType kA, DType kB, DType kOut, Scaling kScaling, bool kBRowBlocks>
cudaError_t Fp8Variant<kA, kB, kOut, kScaling, kBRowBlocks>::load() {
  using G = VariantFp8Gemm<kA, kB, kOut, kScaling, kBRowBlocks>;
  return load_kernel<typename G::K::Kernel>();
}

}  // namespace pk::gemm
