// The block backward's kernel skeleton: the warp roles, pipelines and
// barriers around BwdMainloop and KvGradEpilogue (attention_bwd_sm90.cuh).
//
// Launch config: one CTA per (128-row K/V tile, batch, K/V head) in the
// TileScheduler's order (KvTileScheduler), 384 threads, the shared storage
// below (one CTA per SM).
// Arguments: the problem (B, Hkv, S, T, D), the mainloop's, the epilogue's
// and the SM count (AttentionKernelBase::Arguments).
// Roles: warpgroup 0 gives up registers (24 a thread); its warp 0 adds each
// query tile's dQ into global dq (BwdMainloop::reduce), its warp 1 loads K
// and V once and Q, lse, dO and delta' per visible query tile
// (BwdMainloop::load). Warpgroups 1 and 2 (240 registers a thread) each own
// 64 K/V rows (BwdMainloop::compute: their exponentials in turn, an ordered
// barrier), then each writes its own dK and dV rows (the epilogue) without
// waiting for the other.
// Entry point: cutlass::device_kernel<BlockBwdKernel<...>> (fmha_launch.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/common/attention_kernel_base.cuh"

namespace pk::attention_bwd {

template <class Mainloop, class Epilogue, class TileScheduler>
struct BlockBwdKernel : fmha_kernel::AttentionKernelBase<Mainloop, Epilogue, TileScheduler> {
  using Base = fmha_kernel::AttentionKernelBase<Mainloop, Epilogue, TileScheduler>;
  using typename Base::Params;  // problem (B, Hkv, S, T, D), mainloop, epilogue, scheduler
  static constexpr int kMathWarpGroups = Base::kMathWarpGroups;

  // Q and lse, then dO and delta', one stage each per query tile.
  using PipelineQ = typename Mainloop::MainloopPipeline;
  // K and V of each math warpgroup's rows, loaded once (Mainloop::kOuterLoads
  // stages a warpgroup).
  using PipelineKV = typename Mainloop::MainloopPipelineQ;
  // Each query tile's dQ in shared memory, from the math warpgroups to the
  // reducer warp.
  using PipelineReducer = cutlass::PipelineAsync<2>;
  // The math warpgroups' exponentials in turn (BwdMainloop::compute), two
  // stages a warpgroup.
  using OrderBarrier = cutlass::OrderedSequenceBarrier<2, kMathWarpGroups>;

  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelineKV::SharedStorage pipeline_kv;
    alignas(16) typename PipelineReducer::SharedStorage pipeline_reducer;
    alignas(16) typename OrderBarrier::SharedStorage order;
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
    using namespace cute;
    TileScheduler scheduler{params.tile_scheduler};
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const int lane_predicate = cute::elect_one_sync();
    const bool loader = warp_group == 0 && warp_in_group == 1;   // the producer warp
    const bool reducer = warp_group == 0 && warp_in_group == 0;  // the dQ warp
    const int math = warp_group - 1;                              // math warpgroup, or -1

    if (cutlass::canonical_warp_idx_sync() == 0 && lane_predicate)
      Mainloop::prefetch_tma_descriptors(params.mainloop);

    typename PipelineQ::Params q_params;
    q_params.transaction_bytes = Mainloop::kInnerLoadBytes;
    q_params.is_leader = loader && lane_predicate;
    q_params.num_consumers = kMathWarpGroups * cutlass::NumThreadsPerWarpGroup;
    typename PipelineKV::Params kv_params;
    kv_params.transaction_bytes = Mainloop::kOuterLoadBytes;
    kv_params.is_leader = loader && lane_predicate;
    kv_params.num_consumers = cutlass::NumThreadsPerWarpGroup;  // a warpgroup's own stages
    typename PipelineReducer::Params red_params;
    red_params.producer_arv_count = kMathWarpGroups * cutlass::NumThreadsPerWarpGroup;
    red_params.consumer_arv_count = cutlass::NumThreadsPerWarp;
    if (loader) {
      q_params.role = PipelineQ::ThreadCategory::Producer;
      kv_params.role = PipelineKV::ThreadCategory::Producer;
    } else if (reducer) {
      red_params.role = PipelineReducer::ThreadCategory::Consumer;
    } else if (math >= 0) {
      q_params.role = PipelineQ::ThreadCategory::Consumer;
      kv_params.role = PipelineKV::ThreadCategory::Consumer;
      red_params.role = PipelineReducer::ThreadCategory::Producer;
    }
    PipelineQ pipeline_q(storage.pipeline_q, q_params, Shape<_1, _1, _1>{});
    PipelineKV pipeline_kv(storage.pipeline_kv, kv_params, Shape<_1, _1, _1>{});
    PipelineReducer pipeline_reducer(storage.pipeline_reducer, red_params);
    typename OrderBarrier::Params order_params;
    order_params.group_id = math < 0 ? 0 : math;
    order_params.group_size = cutlass::NumThreadsPerWarpGroup;
    OrderBarrier order(storage.order, order_params);
    __syncthreads();  // the barriers' initialization, visible to every thread

    Mainloop mainloop;
    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Base::kLoadRegisters>();
      if (loader) {
        auto write_q = cutlass::make_producer_start_state<PipelineQ>();
        auto write_kv = cutlass::make_producer_start_state<PipelineKV>();
        for (; scheduler.is_valid(); ++scheduler)
          mainloop.load(scheduler.get_block_coord(), params.mainloop, params.problem_size,
                        pipeline_q, write_q, pipeline_kv, write_kv, storage.mainloop);
      } else if (reducer) {
        cutlass::PipelineState<PipelineReducer::Stages> read_red;
        for (; scheduler.is_valid(); ++scheduler)
          mainloop.reduce(scheduler.get_block_coord(), params.mainloop, params.problem_size,
                          pipeline_reducer, read_red, storage.mainloop);
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::kMathRegisters>();
    typename Mainloop::PipelineState read_q;
    typename Mainloop::PipelineStateQ read_kv;
    auto write_red = cutlass::make_producer_start_state<PipelineReducer>();
    for (; scheduler.is_valid(); ++scheduler) {
      auto blk = scheduler.get_block_coord();
      auto wg_coord = blk;
      get<1>(wg_coord) = kMathWarpGroups * get<1>(blk) + math;  // this warpgroup's 64 K/V rows
      read_kv.advance(Mainloop::kOuterLoads * math);            // its K and V stages
      auto result = mainloop.compute(blk, wg_coord, params.mainloop, params.problem_size,
                                     pipeline_q, read_q, pipeline_kv, read_kv, pipeline_reducer,
                                     write_red, storage.mainloop, order);
      read_kv.advance(Mainloop::kOuterLoads * (kMathWarpGroups - 1 - math));
      Epilogue{}(wg_coord, result, params.problem_size, params.epilogue);
    }
  }
};

}  // namespace pk::attention_bwd
