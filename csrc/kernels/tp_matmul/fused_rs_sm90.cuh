// The fused matmul_reduce_scatter kernel: CUTLASS's warp-specialized
// cooperative sm90 GEMM (the ops' DefaultTiles mainloop, persistent tile
// scheduler) over all n*m rows of x, with ScatterEpilogue deciding where each
// output tile goes, and RotatedTileScheduler walking each rank's peers' rows
// first. One launch per call: the peers' tiles cross NVLink (bulk copies)
// while later tiles' mainloops run, and each of our tiles waits only for the
// same tile of every peer (per-tile flags), not for whole GEMMs.
// One file per (input type, B layout): fused_rs_<type>[_bt].cu.
#pragma once

#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "kernels/gemm/gemm_sm90.cuh"
#include "kernels/tp_matmul/rotated_scheduler.cuh"
#include "kernels/tp_matmul/scatter_epilogue.cuh"
#include "kernels/tp_matmul/tp_matmul.h"

namespace pk::tp_matmul {

template <typename In, typename LayoutB>
struct FusedRsGemm {
  // ---- launch config -----------------------------------------------------------
  using Tiles = gemm::DefaultTiles;
  using Epilogue = ScatterCollective<In, typename Tiles::TileShape>;
  using Mainloop =
      gemm::Sm90Mainloop<In, LayoutB, Tiles, sizeof(typename Epilogue::TensorStorage)>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, RotatedRows>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // ---- entry point ---------------------------------------------------------------
  // x [n*m, K] @ w ([K, N], or [N, K] for a column-major LayoutB).
  static cudaError_t run(const Params& p, const ScatterTarget& t, cudaStream_t stream) {
    const int rows = int(p.n * p.m), n = int(p.n_cols), k = int(p.k);
    cutlass::KernelHardwareInfo hw{p.gemm_dev.ordinal, p.gemm_dev.sm_count};
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {rows, n, k, 1},
        {static_cast<const In*>(p.x),
         cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {rows, k, 1}),
         static_cast<const In*>(p.w),
         cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1})},
        {t},
        hw};
    // Tiles along N within a row (the rotation moves whole rows), starting at
    // the next rank's rows: ours come last.
    args.scheduler.raster_order =
        cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
    args.scheduler.row_shift = int((p.rank + 1) % p.n * (p.m / kFusedTileM));
    return gemm::launch<Adapter>(args, p.gemm_dev, stream);
  }

  static cudaError_t load() { return gemm::load_kernel<Kernel>(); }
};

}  // namespace pk::tp_matmul

// run_fused_rs_<name> / load_fused_rs_<name>, dispatched by fused_rs.cu.
#define PK_FUSED_RS_INSTANTIATION(name, In, LayoutB)                                    \
  namespace pk::tp_matmul {                                                           \
  cudaError_t run_fused_rs_##name(const Params& p, const ScatterTarget& t,            \
                                  cudaStream_t s) {                                   \
    return FusedRsGemm<In, LayoutB>::run(p, t, s);                                    \
  }                                                                                   \
  cudaError_t load_fused_rs_##name() { return FusedRsGemm<In, LayoutB>::load(); }     \
  }
