// The fused ring attention forward's kernel skeleton: the warp roles,
// pipelines and barriers around RingMainloop and RingEpilogue.
//
// Launch config: one CTA per (128-row query tile, batch, query head) in the
// TileScheduler's order (attention_sm90.cuh), or, for persistent CTAs, one
// per SM taking tile after tile; 384 threads, the shared storage below (one
// CTA per SM).
// Arguments: the problem (B, Hq, Sq, Skv, D), the mainloop's, the
// epilogue's and the SM count (AttentionKernelBase::Arguments).
// Roles: warpgroup 0 gives up registers (24 a thread, 40 persistent); its
// warp 1 loads Q and the K/V tiles (RingMainloop::load). Warpgroups 1 and 2
// (240 registers a thread, 232 persistent) run QK, softmax and PV on 64
// query rows each (RingMainloop::compute), their first QK GEMMs in turn (an
// ordered barrier), then each writes its own rows (RingEpilogue) without
// waiting for the other.
// Entry point: cutlass::device_kernel<RingFwdKernel<...>> (fmha_launch.cuh).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/common/attention_kernel_base.cuh"

namespace pk::ring_attention {

// The frame with the register split: persistent CTAs' producer loops over
// tiles and spills in 24 registers a thread; 40 leave the math warpgroups 232.
template <class Mainloop, class Epilogue, class TileScheduler>
using RingFwdBase =
    fmha_kernel::AttentionKernelBase<Mainloop, Epilogue, TileScheduler,
                                     Mainloop::kPersistent ? 40 : 24,
                                     Mainloop::kPersistent ? 232 : 240>;

template <class Mainloop, class Epilogue, class TileScheduler>
struct RingFwdKernel : RingFwdBase<Mainloop, Epilogue, TileScheduler> {
  using Base = RingFwdBase<Mainloop, Epilogue, TileScheduler>;
  using typename Base::Params;  // problem (B, Hq, Sq, Skv, D), mainloop, epilogue, scheduler
  static constexpr int kMathWarpGroups = Base::kMathWarpGroups;

  using PipelineKV = typename Mainloop::MainloopPipeline;
  using PipelineQ = typename Mainloop::MainloopPipelineQ;
  // Each math warpgroup's first QK GEMM in turn (RingMainloop::compute).
  using OrderBarrier = cutlass::OrderedSequenceBarrier<1, kMathWarpGroups>;

  // Warpgroup w's O overlays its own Q stage (RingEpilogue), or, for
  // persistent CTAs (the next tile's Q loads there), has its own.
  union OverlaidTensors {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::TensorStorage epilogue[kMathWarpGroups];
  };
  struct SeparateTensors {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::TensorStorage epilogue[kMathWarpGroups];
  };
  struct SharedStorage {
    std::conditional_t<Epilogue::kOwnSharedMemory, SeparateTensors, OverlaidTensors> tensors;
    alignas(16) typename PipelineKV::SharedStorage pipeline_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename OrderBarrier::SharedStorage order;
    int wait_failed;  // the producer's: one of its waits failed (RingMainloop::load)
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
    using namespace cute;
    TileScheduler scheduler{params.tile_scheduler};
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const int lane_predicate = cute::elect_one_sync();
    const bool loader = warp_group == 0 && warp_in_group == 1;  // the producer warp
    const int math = warp_group - 1;                             // math warpgroup, or -1

    if (cutlass::canonical_warp_idx_sync() == 0 && lane_predicate) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
    }

    typename PipelineKV::Params kv_params;
    kv_params.transaction_bytes = Mainloop::kInnerLoadBytes;
    kv_params.is_leader = loader && lane_predicate;
    kv_params.num_consumers = kMathWarpGroups * cutlass::NumThreadsPerWarpGroup;
    typename PipelineQ::Params q_params;
    q_params.transaction_bytes = Mainloop::kOuterLoadBytes;
    q_params.is_leader = loader && lane_predicate;
    q_params.num_consumers = cutlass::NumThreadsPerWarpGroup;  // a Q stage per warpgroup
    if (loader) {
      kv_params.role = PipelineKV::ThreadCategory::Producer;
      q_params.role = PipelineQ::ThreadCategory::Producer;
    } else if (math >= 0) {
      kv_params.role = PipelineKV::ThreadCategory::Consumer;
      q_params.role = PipelineQ::ThreadCategory::Consumer;
    }
    PipelineKV pipeline_kv(storage.pipeline_kv, kv_params, Shape<_1, _1, _1>{});
    PipelineQ pipeline_q(storage.pipeline_q, q_params, Shape<_1, _1, _1>{});
    typename OrderBarrier::Params order_params;
    order_params.group_id = math < 0 ? 0 : math;
    order_params.group_size = cutlass::NumThreadsPerWarpGroup;
    OrderBarrier order(storage.order, order_params);
    if (threadIdx.x == 0) storage.wait_failed = 0;
    __syncthreads();  // the barriers' and the flag's initialization, visible to every thread

    Mainloop mainloop;
    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Base::kLoadRegisters>();
      if (!loader) return;
      auto write_kv = cutlass::make_producer_start_state<PipelineKV>();
      auto write_q = cutlass::make_producer_start_state<PipelineQ>();
      for (; scheduler.is_valid(); ++scheduler)
        mainloop.load(scheduler.get_block_coord(), params.mainloop, params.problem_size,
                      pipeline_kv, write_kv, pipeline_q, write_q, storage.tensors.mainloop,
                      storage.wait_failed);
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::kMathRegisters>();
    typename Mainloop::PipelineState read_kv;
    typename Mainloop::PipelineStateQ read_q;
    for (; scheduler.is_valid(); ++scheduler) {
      auto blk = scheduler.get_block_coord();
      auto wg_coord = blk;
      get<0>(wg_coord) = kMathWarpGroups * get<0>(blk) + math;  // this warpgroup's 64 rows
      read_q.advance(math);  // its Q stage
      auto result = mainloop.compute(blk, wg_coord, params.mainloop, params.problem_size,
                                     pipeline_kv, read_kv, pipeline_q, read_q,
                                     storage.wait_failed, storage.tensors.mainloop, order);
      read_q.advance(kMathWarpGroups - math);
      Epilogue{}(typename Mainloop::TileShapePV{}, wg_coord, result,
                 typename Mainloop::TiledMmaPV{}, params.problem_size, params.epilogue,
                 storage.tensors.epilogue[math]);
    }
    Epilogue::finish();
  }
};

}  // namespace pk::ring_attention
