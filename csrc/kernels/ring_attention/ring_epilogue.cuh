// The ring attention kernel's epilogue: CUTLASS's Hopper FMHA forward
// epilogue (examples/88_hopper_fmha/collective/fmha_epilogue.hpp: O through
// the sm90 TMA store epilogue, the log-sum-exp by plain stores) with 64-bit
// strides. The example's takes `int` strides, and O's batch stride
// s_local * Hq * D reaches 2^31 elements at sizes a GPU holds (s_local =
// 131072, Hq = 128, D = 128: 4 GiB of bf16 per batch), where an `int` stride
// would wrap and the stores land at the wrong place. Nothing else differs.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/default_epilogue.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>

#include "collective/fmha_common.hpp"

namespace pk::ring_attention {

// O [B, S, H, D]: (seq, dim, (batch, head)) strides; lse [B, H, S]: (seq,
// (batch, head)).
using StrideO = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, int64_t>>;
using StrideLse = cute::tuple<cute::_1, cute::tuple<int64_t, int64_t>>;

template <class Element, class ElementAccumulator, class TileShape_WG>
struct RingEpilogue {
  static constexpr int Alignment = 16 / sizeof(Element);

  using DefaultOperation =
      cutlass::epilogue::fusion::LinearCombination<Element, ElementAccumulator, void>;
  using CollectiveEpilogueTMA = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_WG,
      cute::Shape<cute::_1, cute::_1, cute::_1>, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator, void, StrideO, Alignment, Element, StrideO,
      Alignment, cutlass::epilogue::TmaWarpSpecialized, DefaultOperation>::CollectiveOp;

  struct Arguments {
    Element* ptr_O;
    StrideO dO;
    ElementAccumulator* ptr_LSE;
    StrideLse dLSE;
  };

  struct Params {
    ElementAccumulator* ptr_LSE;
    StrideLse dLSE;
    typename CollectiveEpilogueTMA::Params epilogue_TMA;
  };

  using TensorStorage = typename CollectiveEpilogueTMA::TensorStorage;
  using PipelineStorage = typename CollectiveEpilogueTMA::PipelineStorage;
  using LoadPipeline = typename CollectiveEpilogueTMA::LoadPipeline;
  static constexpr int TmaTransactionBytes = CollectiveEpilogueTMA::TmaTransactionBytes;

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, Arguments const& args,
                                        void* workspace = nullptr) {
    using namespace cute;
    auto problem_size_o = make_shape(get<2>(problem_size), get<4>(problem_size), 1,
                                     make_shape(get<0>(problem_size), get<1>(problem_size)));
    typename CollectiveEpilogueTMA::Arguments args_tma{{}, args.ptr_O, args.dO, args.ptr_O,
                                                       args.dO};
    return Params{args.ptr_LSE, args.dLSE,
                  CollectiveEpilogueTMA::to_underlying_arguments(problem_size_o, args_tma,
                                                                 workspace)};
  }

  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma,
            class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const& tile_shape, BlkCoord const& blk_coord,
                                 ResultTuple const& result, TiledMma const& tiled_mma,
                                 ProblemShape const& problem_size, Params const& params,
                                 LoadPipeline epi_load_pipeline,
                                 TensorStorage& epi_tensor_storage) {
    using namespace cute;
    using X = Underscore;
    using cutlass::fmha::collective::layout_acc_mn;

    auto acc = get<0>(result);
    auto lse = get<1>(result);

    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);

    const int seqlen_q = get<2>(problem_size);
    const int num_batch = get<0>(problem_size);
    const int num_heads = get<1>(problem_size);
    // The log-sum-exp: plain stores of the first column's threads.
    Tensor mLSE = make_tensor(make_gmem_ptr(params.ptr_LSE),
                              make_shape(seqlen_q, get<1>(tile_shape), make_shape(num_batch, num_heads)),
                              make_stride(_1{}, _0{}, get<1>(params.dLSE)));
    Tensor gLSE_full = local_tile(mLSE, tile_shape, make_coord(_, _, _), Step<_1, _1, X>{});
    Tensor gLSE = gLSE_full(_, _, get<0>(blk_coord), get<1>(blk_coord), get<2>(blk_coord));
    Tensor tOgLSE = thr_mma.partition_C(gLSE);
    Tensor cO = make_identity_tensor(take<0, 2>(tile_shape));
    Tensor tOcO = thr_mma.partition_C(cO);
    if (get<1>(tOcO(_0{})) == 0) {
      auto tOgLSE_mn = make_tensor(tOgLSE.data(), layout_acc_mn(tiled_mma, tOgLSE.layout()));
      auto tOcO_mn = make_tensor(tOcO.data(), layout_acc_mn(tiled_mma, tOcO.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(tOgLSE_mn); i++) {
        if (get<0>(tOcO_mn(i)) + get<0>(blk_coord) * get<0>(tile_shape) < get<2>(problem_size)) {
          tOgLSE_mn(i, _0{}) = lse(i);
        }
      }
    }
    auto problem_size_o = make_shape(get<2>(problem_size), get<4>(problem_size), _,
                                     make_shape(get<0>(problem_size), get<1>(problem_size)));

    // O through the TMA store epilogue.
    CollectiveEpilogueTMA epilogue_tma(params.epilogue_TMA, epi_tensor_storage);

    using EpiStorePipeline = typename CollectiveEpilogueTMA::StorePipeline;
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    typename CollectiveEpilogueTMA::LoadPipelineState epi_load_pipe_consumer_state;
    auto epi_store_pipe_producer_state = cutlass::make_producer_start_state<EpiStorePipeline>();

    auto [epi_load_pipe_consumer_state_next, epi_store_pipe_producer_state_next] =
        epilogue_tma.store(epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
                           epi_store_pipe_producer_state, problem_size_o, tile_shape,
                           make_coord(get<0>(blk_coord), _0{}, _, get<2>(blk_coord)), acc,
                           tiled_mma, threadIdx.x % cutlass::NumThreadsPerWarpGroup,
                           epi_tensor_storage);

    epilogue_tma.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state_next,
                            epi_store_pipeline, epi_store_pipe_producer_state_next);
  }
};

}  // namespace pk::ring_attention
