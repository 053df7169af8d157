// The sm90 GEMM: CUTLASS's TMA warp-specialized cooperative kernel with a
// persistent tile scheduler (128x256x64 tiles, 2x1 clusters), instantiated
// once per (input type, output type, B layout) in gemm_<in>_<out>[_bt].cu
// (PK_GEMM_INSTANTIATION). B row-major is [k, n]; column-major is B^T stored
// row-major [n, k] (K-major, wgmma's native operand order).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "kernels/gemm/gemm.h"

namespace pk::gemm {

template <typename In, typename Out, typename LayoutB>
struct Sm90Gemm {
  using Row = cutlass::layout::RowMajor;
  // 128x256 output tiles: two consumer warpgroups of 64x256 each; 64-deep K
  // steps; the stage count fills the shared memory the epilogue leaves.
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static constexpr int kAlignIn = 16 / sizeof(In);
  static constexpr int kAlignOut = 16 / sizeof(Out);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, Row, kAlignOut, Out,
      Row, kAlignOut, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, In, Row, kAlignIn, In, LayoutB,
      kAlignIn,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
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
    Adapter gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (Adapter::get_workspace_size(args) > dev.workspace_bytes) return cudaErrorInvalidValue;
    if (gemm.initialize(args, dev.workspace, stream) != cutlass::Status::kSuccess)
      return cudaErrorInvalidValue;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }

  static cudaError_t load() {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, cutlass::device_kernel<Kernel>);
  }
};

}  // namespace pk::gemm

// The two entry points of one instantiation, gemm.cu's run_<name> and
// load_<name>: each instantiation is its own translation unit (they compile
// in parallel).
#define PK_GEMM_INSTANTIATION(name, In, Out, LayoutB)                                  \
  namespace pk::gemm {                                                                \
  cudaError_t run_##name(const Problem& p, const Device& dev, cudaStream_t stream) {  \
    return Sm90Gemm<In, Out, LayoutB>::run(p, dev, stream);                          \
  }                                                                                   \
  cudaError_t load_##name() { return Sm90Gemm<In, Out, LayoutB>::load(); }           \
  }
