// The sm90 GEMM: CUTLASS's TMA warp-specialized kernel with a persistent tile
// scheduler, its tiles a template parameter (gemm.h's Tiles: DefaultTiles,
// 128x256x64, 2x1 clusters, cooperative; NarrowTiles, 128x128x64, 2x1
// clusters, ping-pong, where tile_table.h picks it), instantiated once per
// (input type, output type, B layout, A layout, tiles) in
// gemm_<in>_<out>[_bt|_at|_narrow].cu (gemm.h: Variant). B row-major is
// [k, n]; column-major is B^T stored row-major [n, k] (K-major, wgmma's
// native operand order). A row-major is [m, k]; column-major is A^T stored
// row-major [k, m] (M-major: wgmma reads 16-bit operands of either major from
// shared memory), the weight gradients' X^T.
//
// Launch config: CUTLASS's (persistent grid of at most one CTA per SM, 2x1
// clusters). Arguments: gemm.h's Problem. Roles: one producer warpgroup (TMA
// loads), two consumer warpgroups (wgmma, epilogue: on one tile, or each on
// its own with ping-pong). Entry point: Variant<...>::launch.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <type_traits>

#include "kernels/common/cutlass_type.cuh"
#include "kernels/gemm/gemm.h"

namespace pk::gemm {

// One tile configuration: CTA tile, cluster, the kernel schedule with its
// matching epilogue schedule (cooperative: two consumer warpgroups share a
// tile; ping-pong: each has its own) and the tile scheduler (persistent
// data-parallel, or stream-K: K split across CTAs where tiles are few).
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_,
          class Scheduler_ = cutlass::gemm::PersistentScheduler>
struct Sm90Tiles {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;
  using Scheduler = Scheduler_;
};

// What the ops run: 128x256 output tiles (two consumer warpgroups of 64x256
// each), 64-deep K steps, 2x1 clusters. tools/gemm_sweep times others.
using DefaultTiles = Sm90Tiles<cute::Shape<cute::_128, cute::_256, cute::_64>,
                               cute::Shape<cute::_2, cute::_1, cute::_1>,
                               cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                               cutlass::epilogue::TmaWarpSpecializedCooperative>;

// Few-tile grids (tile_table.h): 128x128 output tiles, each consumer
// warpgroup on its own tile, their mainloops and epilogues taking turns.
using NarrowTiles = Sm90Tiles<cute::Shape<cute::_128, cute::_128, cute::_64>,
                              cute::Shape<cute::_2, cute::_1, cute::_1>,
                              cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                              cutlass::epilogue::TmaWarpSpecialized>;

template <Tiles kTiles>
using TilesOf = std::conditional_t<kTiles == Tiles::kNarrow, NarrowTiles, DefaultTiles>;

// What launch() checks before it touches the stream.
template <class Adapter>
cudaError_t check(typename Adapter::Arguments const& args, const Device& dev) {
  if (Adapter::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (Adapter::get_workspace_size(args) > dev.workspace_bytes) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// Check, initialize (scratch from `dev`) and launch one CUTLASS kernel
// through its device adapter.
template <class Adapter>
cudaError_t launch(typename Adapter::Arguments const& args, const Device& dev,
                   cudaStream_t stream) {
  Adapter gemm;
  if (cudaError_t err = check<Adapter>(args, dev); err != cudaSuccess) return err;
  if (gemm.initialize(args, dev.workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// Load a kernel's module on the current device (no lazy load later).
template <class Kernel>
cudaError_t load_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, cutlass::device_kernel<Kernel>);
}

template <typename In, typename Out, typename LayoutB, typename Tiles = DefaultTiles,
          typename LayoutA = cutlass::layout::RowMajor>
struct Sm90Gemm {
  using Row = cutlass::layout::RowMajor;
  using TileShape = typename Tiles::TileShape;
  using ClusterShape = typename Tiles::ClusterShape;
  static constexpr int kAlignOut = 16 / sizeof(Out);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, Row, kAlignOut, Out,
      Row, kAlignOut, typename Tiles::EpilogueSchedule>::CollectiveOp;
  // TMA loads of A and B, wgmma, fp32 accumulators; the
  // stage count fills the shared memory the epilogue leaves.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, In, LayoutA, 16 / sizeof(In), In,
      LayoutB,
      16 / sizeof(In), float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, typename Tiles::Scheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // swizzle: the persistent scheduler's tile swizzle (1, 2, 4 or 8 tiles
  // along the rasterized dimension share L2 for their operands).
  static typename Adapter::Arguments arguments(const Problem& p, const Device& dev, int swizzle) {
    const int m = int(p.m), n = int(p.n), k = int(p.k);
    auto* a = static_cast<const In*>(p.a);
    auto* b = static_cast<const In*>(p.b);
    auto* d = static_cast<Out*>(p.d);
    // With C, beta = 1 and the epilogue loads it (TMA); without, beta = 0 and
    // CUTLASS skips the load, so C may alias D.
    auto* c = p.c ? static_cast<const Out*>(p.c) : d;
    cutlass::KernelHardwareInfo hw{dev.ordinal, dev.sm_count};
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {a, cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1}), b,
         cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1})},
        {{1.0f, p.c ? 1.0f : 0.0f},
         c,
         cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1}),
         d,
         cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1})},
        hw};
    args.scheduler.max_swizzle_size = swizzle;
    return args;
  }

  static cudaError_t check(const Problem& p, const Device& dev, int swizzle = 1) {
    return pk::gemm::check<Adapter>(arguments(p, dev, swizzle), dev);
  }

  static cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream,
                         int swizzle = 1) {
    return launch<Adapter>(arguments(p, dev, swizzle), dev, stream);
  }

  static cudaError_t load() { return load_kernel<Kernel>(); }
};

// The instantiations (gemm.h: Variant) over the types the ops take.
// B [k, n] row-major, or transposed: [n, k] row-major, i.e. column-major [k, n];
// A [m, k] row-major, or transposed: [k, m] row-major, i.e. column-major [m, k].
template <bool kTransposed>
using Major = std::conditional_t<kTransposed, cutlass::layout::ColumnMajor,
                                 cutlass::layout::RowMajor>;

template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed, Tiles kTiles>
using VariantGemm = Sm90Gemm<typename CutlassType<kIn>::Type, typename CutlassType<kOut>::Type,
                             Major<kBTransposed>, TilesOf<kTiles>, Major<kATransposed>>;

template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed, Tiles kTiles>
cudaError_t Variant<kIn, kOut, kBTransposed, kATransposed, kTiles>::check(const Problem& p,
                                                                          const Device& dev) {
  return VariantGemm<kIn, kOut, kBTransposed, kATransposed, kTiles>::check(p, dev);
}

template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed, Tiles kTiles>
cudaError_t Variant<kIn, kOut, kBTransposed, kATransposed, kTiles>::launch(
    const Problem& p, const Device& dev, cudaStream_t stream) {
  return VariantGemm<kIn, kOut, kBTransposed, kATransposed, kTiles>::run(p, dev, stream);
}

template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed, Tiles kTiles>
cudaError_t Variant<kIn, kOut, kBTransposed, kATransposed, kTiles>::load() {
  return VariantGemm<kIn, kOut, kBTransposed, kATransposed, kTiles>::load();
}

}  // namespace pk::gemm
