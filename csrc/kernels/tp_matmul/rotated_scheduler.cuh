// CUTLASS's persistent sm90 tile scheduler with the rows of tiles rotated:
// the fused matmul_reduce_scatter on rank r walks the row blocks r+1, r+2,
// ..., r (tiles along N within each row, raster AlongN), so every rank sends
// its partials to its peers first and reaches its own rows, which wait for
// the peers' partials, last: by then those were sent half a kernel earlier.
// Without the rotation every rank walks block 0 first, and rank 1's own rows
// wait on rank 0's sends, which rank 0 makes last.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace pk::tp_matmul {

// Tag for GemmUniversal (mapped to RotatedTileScheduler below).
struct RotatedRows {};

class RotatedTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int row_shift = 0;  // tile rows the walk starts below row 0
  };
  struct Params : Base::Params {
    int row_shift = 0;
    int tiles_m = 0;  // tile rows of the problem (the scheduler's may be padded to the cluster)
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        problem_shape_mnkl, tile_shape, cluster_shape, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    p.tiles_m = int(cute::ceil_div(cute::get<0>(problem_shape_mnkl), cute::size<0>(tile_shape)));
    p.row_shift = p.tiles_m > 0 ? args.row_shift % p.tiles_m : 0;
    return p;
  }

  CUTLASS_HOST_DEVICE RotatedTileScheduler() {}
  CUTLASS_DEVICE explicit RotatedTileScheduler(Params const& params)
      : Base(params), row_shift_(params.row_shift), tiles_m_(params.tiles_m) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster_shape) {
    return rotated(Base::initial_work_tile_info(cluster_shape));
  }

  // Both of the base's forms (with and without the scheduler pipeline).
  template <class... Pipeline>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&&... pipeline) {
    auto next = Base::fetch_next_work(work, static_cast<Pipeline&&>(pipeline)...);
    cute::get<0>(next) = rotated(cute::get<0>(next));
    return next;
  }

 private:
  int row_shift_ = 0;
  int tiles_m_ = 0;

  // Rows the cluster padding adds past the problem stay where they are.
  CUTLASS_DEVICE WorkTileInfo rotated(WorkTileInfo w) const {
    if (w.is_valid() && w.M_idx < tiles_m_) w.M_idx = (w.M_idx + row_shift_) % tiles_m_;
    return w;
  }
};

}  // namespace pk::tp_matmul

namespace cutlass::gemm::kernel::detail {

template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<pk::tp_matmul::RotatedRows, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = pk::tp_matmul::RotatedTileScheduler;
};

}  // namespace cutlass::gemm::kernel::detail
