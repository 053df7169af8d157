// The mainloop of the block backward kernel, on the building blocks of
// CUTLASS's Hopper FMHA backward (the nvidia-cutlass wheel ships them under
// examples/88_hopper_fmha: its collective's types, shared storage, pipelines
// and GEMM shapes). One CTA owns one 128-row K/V tile (two math warpgroups of
// 64 rows) of one K/V head and walks the query tiles of every query head of
// that head's GQA group, so dK/dV sum over the group in registers. What
// differs from the example:
//   * the inner walk (BwdWalk, bwd_walk.cuh) runs over (query head of the group, query
//     tile) and skips, in the producer, both math warpgroups and the dQ
//     reducer alike, every tile the causal mask hides wholly; tiles that
//     cross the diagonal are masked by global token positions (kv_walk.cuh's
//     Geometry, contiguous or zigzag), the ranks read from device memory;
//   * K/V TMAs use the K/V head count, Q/dO/lse/delta and dQ the query's;
//   * the softmax scale is an argument, delta' = rowsum(dO * O) - dlse comes
//     in (the example's sum_OdO), and dS is converted explicitly to the
//     element type: the example assigns a float to its element, which only
//     cutlass::half_t allows (why its README says "fp16 only"; bf16 works
//     with the explicit conversion).
// Per tile: S = K Q^T and dP = V dO^T (wgmma from shared memory), P =
// exp2(S * scale * log2 e - lse * log2 e), dV += P dO, dS = P (dP - delta')
// * scale (to the element type, through shared memory), dK += dS Q, and
// dQ = dS^T K over the CTA's 128 K rows (each math warpgroup half of it,
// TiledMmaDQ), which the reducer warp adds into global dq with a TMA
// reduce-add.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "collective/fmha_collective_bwd_tma_warpspecialized.hpp"
#include "collective/fmha_fusion.hpp"

#include "kernels/attention_bwd/bwd_walk.cuh"
#include "kernels/common/fast_math.cuh"

namespace pk::attention_bwd {

using namespace cute;
namespace fmha = cutlass::fmha::collective;

template <class Element, class TileShape>
struct BwdMainloop
    : fmha::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, fmha::DefaultFusion> {
  using Base = fmha::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, fmha::DefaultFusion>;
  using typename Base::CollectiveMmaNM;
  using typename Base::LoadDO;
  using typename Base::LoadK;
  using typename Base::LoadLSE;
  using typename Base::LoadODO;
  using typename Base::LoadQ;
  using typename Base::LoadV;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::SmemLayoutDO;
  using typename Base::SmemLayoutDOp;
  using typename Base::SmemLayoutDQ;
  using typename Base::SmemLayoutDS;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutKp;
  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutQp;
  using typename Base::SmemLayoutV;
  using typename Base::TiledMmaND;
  using typename Base::TiledMmaND_SS;
  using typename Base::TiledMmaNM;
  using typename Base::TileShapeMD;
  using typename Base::TileShapeND;
  using typename Base::TileShapeNM;
  using typename Base::TMA_DQ;
  using typename Base::TMA_LSE;
  using typename Base::TMA_ODO;
  using Base::NumMmaWarpGroups;
  using Base::StageCount;
  static_assert(!Base::kIsPersistent, "one K/V tile per CTA");

  static constexpr int kTileQ = get<0>(TileShape{});
  static constexpr int kTileKv = get<1>(TileShape{});
  static constexpr int kWgRows = get<0>(TileShapeNM{});  // K/V rows per math warpgroup
  static constexpr int kDim = get<2>(TileShape{});

  // dQ = dS^T K, a (query rows, head dim) tile over the CTA's K/V rows, half
  // of it in each math warpgroup so that both do the same GEMM work per tile
  // (S, dP, dV, dK and half of dQ): split along the query rows where they
  // are 128, else along the head dim. Both operands from shared memory in
  // the example's layouts (dS^T M-major, K^T N-major).
  static constexpr bool kDqSplitRows = kTileQ >= 128;
  using DqWarpgroupShape = Shape<Int<kDqSplitRows ? kTileQ / 2 : kTileQ>,
                                 Int<kDqSplitRows ? kDim : kDim / 2>, Int<kWgRows>>;
  using TiledMmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, DqWarpgroupShape, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      Layout<std::conditional_t<kDqSplitRows, Shape<_2, _1, _1>, Shape<_1, _2, _1>>>{}));
  static_assert(NumMmaWarpGroups == 2, "dQ is split between two math warpgroups");
  // The K/V pipeline's stage of warpgroup j's K rows: the producer loads K and
  // V of warpgroup j into stages 2j and 2j + 1, once per CTA.
  template <int j>
  CUTLASS_HOST_DEVICE static constexpr auto k_stage() {
    return Int<2 * j>{};
  }

  // Named barriers of the two math warpgroups around dS in shared memory
  // (ids after CUTLASS's reserved ones; nothing else in the kernel uses
  // them). Id 0: both warpgroups' dS of the tile is stored (each GEMM for dQ
  // reads both halves). Id 1 + w: warpgroup w's dQ GEMM has finished reading
  // the tile's dS, so the other warpgroup may overwrite its half; warpgroup w
  // arrives once a tile, the other waits once a tile from its second tile on
  // and once after its last, so the arrivals pair up (and neither can arrive
  // twice before the other waits: between two arrivals it passes id 0, which
  // needs the other's next dS, stored after its wait).
  struct DsBarrier {
    static constexpr uint32_t kThreads = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
    CUTLASS_DEVICE static void sync_stored() { cutlass::arch::NamedBarrier::sync(kThreads, 0); }
    CUTLASS_DEVICE static void arrive_read(int wg) {
      cutlass::arch::NamedBarrier::arrive(kThreads, 1 + wg);
    }
    CUTLASS_DEVICE static void sync_read_by_other(int wg) {
      cutlass::arch::NamedBarrier::sync(kThreads, 2 - wg);
    }
  };

  // Strides (batch, head, row, 1) of [B, rows, heads, D] tensors, and
  // (batch, head, 1) of [B, heads, rows] ones, in the example's order but
  // 64-bit (its `int` batch stride rows * heads * D wraps at sizes a GPU
  // holds; kv_walk.cuh: TensorStrides).
  using Stride4 = cute::tuple<int64_t, int64_t, int64_t, _1>;
  using Stride3 = cute::tuple<int64_t, int64_t, _1>;

  // The example's GEMM collective for S = K Q^T and dP = V dO^T, with the
  // 64-bit strides: its to_underlying_arguments builds our TMA descriptors
  // (the example's takes `int` strides). The descriptors it returns have the
  // example's types (a TMA's type carries no stride width), so the example's
  // loaders and Params take them as they are.
  using StrideNM = cute::tuple<int64_t, _1, cute::tuple<int64_t, int64_t>>;
  using CollectiveMmaNM64 = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, StrideNM, Base::Alignment,
      Element, StrideNM, Base::Alignment, float, TileShapeNM, typename Base::ClusterShape,
      typename Base::Stages, cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp;
  static_assert(std::is_same_v<typename CollectiveMmaNM64::Params::TMA_A, typename Base::TMA_K> &&
                    std::is_same_v<typename CollectiveMmaNM64::Params::TMA_B, typename Base::TMA_Q>,
                "64-bit strides change the TMA types: the example's loaders no longer fit");

  struct Arguments {
    const Element* q;
    Stride4 dq_in;
    const Element* k;
    Stride4 dk_in;
    const Element* v;
    const Element* dout;
    const float* lse;
    Stride3 dlse;
    const float* delta;
    float* dq;
    Stride4 ddq;
    BwdArgs bwd;
  };

  struct Params : Base::Params {
    BwdArgs bwd;
  };

  // Problem shape as the kernel passes it: (B, Hkv, S, T, D); the query
  // side has Hkv * group heads.
  template <class ProblemShape>
  CUTLASS_HOST_DEVICE static auto q_problem(ProblemShape const& p, BwdArgs const& a) {
    return make_shape(get<0>(p), get<1>(p) * a.group, get<2>(p), get<3>(p), get<4>(p));
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& a) {
    return get<4>(problem) == get<2>(TileShape{}) && a.bwd.group >= 1 &&
           get<2>(problem) % kTileQ == 0 && get<3>(problem) % kTileKv == 0;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& a, void*) {
    auto strides = [](Stride4 const& s) {
      return make_stride(get<2>(s), get<3>(s), make_stride(get<0>(s), get<1>(s)));
    };
    // (N = K/V rows, M = query rows, D, (B, heads)): one shape per head count.
    auto nm_shape = [&](int heads) {
      return make_shape(get<3>(problem), get<2>(problem), get<4>(problem),
                        make_shape(get<0>(problem), heads));
    };
    const int hkv = get<1>(problem), hq = hkv * a.bwd.group;
    using MmaArgs = typename CollectiveMmaNM64::Arguments;
    // Operand A (K, V) takes the K/V heads, operand B (Q, dO) the query heads.
    auto kv_k = CollectiveMmaNM64::to_underlying_arguments(
        nm_shape(hkv), MmaArgs{a.k, strides(a.dk_in), a.q, strides(a.dq_in)}, nullptr);
    auto kv_v = CollectiveMmaNM64::to_underlying_arguments(
        nm_shape(hkv), MmaArgs{a.v, strides(a.dk_in), a.dout, strides(a.dq_in)}, nullptr);
    auto q_q = CollectiveMmaNM64::to_underlying_arguments(
        nm_shape(hq), MmaArgs{a.k, strides(a.dk_in), a.q, strides(a.dq_in)}, nullptr);
    auto q_do = CollectiveMmaNM64::to_underlying_arguments(
        nm_shape(hq), MmaArgs{a.v, strides(a.dk_in), a.dout, strides(a.dq_in)}, nullptr);
    auto qp = q_problem(problem, a.bwd);
    auto row_tensor = [&](const float* ptr) {
      return make_tensor(ptr, select<2, 0, 1>(qp), select<2, 0, 1>(a.dlse));
    };
    auto scalar_layout = typename Base::SmemLayoutLSE{}(_, _0{});
    Params p;
    p.tma_load_q = q_q.tma_load_b;
    p.tma_load_k = kv_k.tma_load_a;
    p.tma_load_v = kv_v.tma_load_a;
    p.tma_load_do = q_do.tma_load_b;
    p.tma_load_lse = make_tma_copy(SM90_TMA_LOAD{}, row_tensor(a.lse), scalar_layout);
    p.tma_load_odo = make_tma_copy(SM90_TMA_LOAD{}, row_tensor(a.delta), scalar_layout);
    p.tma_red_dq = make_tma_copy(SM90_TMA_REDUCE_ADD{},
                                 make_tensor(a.dq, select<2, 4, 0, 1>(qp), select<2, 3, 0, 1>(a.ddq)),
                                 SmemLayoutDQ{}(_, _, _0{}));
    p.scale_softmax = a.bwd.scale;
    p.scale_softmax_log2 = float(a.bwd.scale * M_LOG2E);
    p.bwd = a.bwd;
    return p;
  }

  template <class BlkCoord>
  CUTLASS_DEVICE static BwdWalk make_walk(BlkCoord const& blk, Params const& p) {
    return BwdWalk(p.bwd, __ldg(p.bwd.q_rank), __ldg(p.bwd.k_rank), int(get<1>(blk)), kTileQ,
                   kTileKv);
  }

  // ---- producer warp ------------------------------------------------------
  // K and V of both warpgroups' rows once (outer pipeline), then per visible
  // tile: Q with its lse rows in one stage, dO with its delta rows in the next.
  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE void load(BlkCoord const& blk, Params const& p, ProblemShape const& problem,
                           MainloopPipeline& pipeline, PipelineState& write,
                           MainloopPipelineQ& pipeline_kv, PipelineStateQ& write_kv,
                           SharedStorage& storage) {
    const int lane_predicate = cute::elect_one_sync();
    if (!lane_predicate) return;
    auto qp = q_problem(problem, p.bwd);

    LoadK load_k{p.tma_load_k, pipeline_kv, storage.smem_k};
    LoadV load_v{p.tma_load_v, pipeline_kv, storage.smem_v};
    auto k_state = load_k.init_state(_0{}, problem, TileShapeNM{}, blk, NumMmaWarpGroups);
    auto v_state = load_v.init_state(_0{}, problem, TileShapeNM{}, blk, NumMmaWarpGroups);
    // Stages 2w and 2w + 1 hold K and V of warpgroup w's rows.
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < NumMmaWarpGroups; ++w) {
      pipeline_kv.producer_acquire(write_kv);
      copy(p.tma_load_k.with(*pipeline_kv.producer_get_barrier(write_kv), 0),
           get<0>(k_state)(_, _, _, w), get<1>(k_state)(_, _, _, write_kv.index()));
      ++write_kv;
      pipeline_kv.producer_acquire(write_kv);
      copy(p.tma_load_v.with(*pipeline_kv.producer_get_barrier(write_kv), 0),
           get<0>(v_state)(_, _, _, w), get<1>(v_state)(_, _, _, write_kv.index()));
      ++write_kv;
    }

    LoadQ load_q{p.tma_load_q, pipeline, storage.smem_q};
    LoadDO load_do{p.tma_load_do, pipeline, storage.smem_do};
    LoadLSE load_lse{p.tma_load_lse, pipeline, storage.smem_lse};
    LoadODO load_odo{p.tma_load_odo, pipeline, storage.smem_sumOdO};
    BwdWalk walk = make_walk(blk, p);
    int head, q_tile, q_first;
    bool masked;
    while (walk.next(head, q_tile, q_first, masked)) {
      const auto q_blk = make_coord(get<0>(blk), get<1>(blk),
                                    make_coord(get<2, 0>(blk), get<2, 1>(blk) * p.bwd.group + head));
      auto q_state = load_q.init_state(_0{}, qp, TileShapeNM{}, q_blk, 1);
      auto do_state = load_do.init_state(_0{}, qp, TileShapeNM{}, q_blk, 1);
      auto lse_state = load_lse.init_state(_0{}, qp, TileShapeNM{}, q_blk, 1);
      auto odo_state = load_odo.init_state(_0{}, qp, TileShapeNM{}, q_blk, 1);
      // One stage: a [rows, D] tile and its per-row scalars, one barrier.
      auto issue = [&](auto const& tma, auto const& state, auto const& tma_rows, auto const& rows) {
        pipeline.producer_acquire(write);
        auto* bar = pipeline.producer_get_barrier(write);
        copy(tma.with(*bar, 0), get<0>(state)(_, _, _, q_tile), get<1>(state)(_, _, _, write.index()));
        copy(tma_rows.with(*bar, 0), get<0>(rows)(_, _, q_tile), get<1>(rows)(_, _, write.index()));
        ++write;
      };
      issue(p.tma_load_q, q_state, p.tma_load_lse, lse_state);
      issue(p.tma_load_do, do_state, p.tma_load_odo, odo_state);
    }
  }

  // ---- dQ reducer warp -----------------------------------------------------
  // Adds each tile's dQ (written to shared memory by the second math
  // warpgroup) into global dq with a TMA reduce-add.
  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer>
  CUTLASS_DEVICE void reduce(BlkCoord const& blk, Params const& p, ProblemShape const& problem,
                             PipelineReducer& pipeline, PipelineStateReducer& read,
                             SharedStorage& storage) {
    const int lane_predicate = cute::elect_one_sync();
    auto qp = q_problem(problem, p.bwd);
    Tensor mDQ = p.tma_red_dq.get_tma_tensor(select<2, 4, 0, 1>(qp));
    Tensor gDQ_full = local_tile(mDQ, TileShapeMD{}, make_coord(_, _, _), Step<_1, _1, Underscore>{});
    Tensor sDQ = make_tensor(make_smem_ptr(storage.smem_dq.data()), SmemLayoutDQ{});
    auto block_tma = p.tma_red_dq.get_slice(_0{});
    Tensor tDQsDQ = block_tma.partition_S(sDQ);

    PipelineStateReducer release = read;
    BwdWalk walk = make_walk(blk, p);
    int head, q_tile, q_first;
    bool masked, first = true;
    while (walk.next(head, q_tile, q_first, masked)) {
      Tensor gDQ = gDQ_full(_, _, _, _0{}, get<2, 0>(blk), get<2, 1>(blk) * p.bwd.group + head);
      Tensor tDQgDQ = block_tma.partition_D(gDQ);
      pipeline.consumer_wait(read);
      // The previous tile's reduce-add has read its stage before we hand it
      // back (it overlapped this tile's GEMMs).
      if (lane_predicate) tma_store_wait<0>();
      if (!first) {
        pipeline.consumer_release(release);
        ++release;
      }
      first = false;
      if (lane_predicate) {
        copy(p.tma_red_dq, tDQsDQ(_, _, _, read.index()), tDQgDQ(_, _, _, q_tile));
        tma_store_arrive();
      }
      ++read;
    }
    if (lane_predicate) tma_store_wait<0>();
    // Nothing to release when no tile was visible (no stage was taken).
    if (!first) {
      pipeline.consumer_release(release);
      ++release;
    }
  }

  // Accumulator pairs (adjacent columns, contiguous in `dst` under its
  // swizzle) into shared memory, 64 bits a store. `dst` partitions a tensor
  // over shared memory starting at `base`; the addresses are formed as
  // shared-window offsets from it, as the assignment through the swizzled
  // tensor compiled to generic 32-bit stores (ST.E; nvcc 13.0).
  template <class Acc, class Dst>
  CUTLASS_DEVICE static void store_pairs_shared(Acc const& acc, Dst&& dst, float const* base) {
    static_assert(size(Acc{}) % 2 == 0);
    const uint32_t base_smem = cute::cast_smem_ptr_to_uint(base);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const uint32_t at = base_smem + uint32_t(reinterpret_cast<char const*>(&dst(i)) -
                                               reinterpret_cast<char const*>(base));
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc(i)), "f"(acc(i + 1))
                   : "memory");
    }
  }

  // Scores of keys after their query (global tokens) get -inf.
  template <class Acc, class Coords>
  CUTLASS_DEVICE static void mask_future(Acc& acc, Coords const& coords, int k_token0, int q_first) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      auto c = coords(i);  // (K/V row in the warpgroup's rows, query row in the tile)
      if (k_token0 + int(get<0>(c)) > q_first + int(get<1>(c))) acc(i) = -INFINITY;
    }
  }

  // ---- math warpgroups ----------------------------------------------------
  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer,
            class OrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk, BlkCoord const& wg_coord, Params const& p,
                              ProblemShape const&, MainloopPipeline& pipeline,
                              PipelineState& read, MainloopPipelineQ& pipeline_kv,
                              PipelineStateQ& read_kv, PipelineReducer& pipeline_red,
                              PipelineStateReducer& write_red, SharedStorage& storage,
                              OrderBarrier& order) {
    const int thread_idx = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
    const int wg = __shfl_sync(0xffffffff, int(get<1>(wg_coord)) % NumMmaWarpGroups, 0);

    TiledMmaND mma_nd;
    Tensor acc_dv = partition_fragment_C(mma_nd, take<0, 2>(TileShapeND{}));
    Tensor acc_dk = partition_fragment_C(mma_nd, take<0, 2>(TileShapeND{}));
    clear(acc_dv);
    clear(acc_dk);

    // The previous tile's Q stage: its dK GEMM (dK += dS^T Q) may still be
    // reading it when the tile ends, so it is released only after the next
    // tile's first wait (or after the last wait, below).
    PipelineState pending_q = read;
    bool q_pending = false;
    pipeline_kv.consumer_wait(read_kv);
    PipelineStateQ read_k = read_kv;
    ++read_kv;
    pipeline_kv.consumer_wait(read_kv);
    PipelineStateQ read_v = read_kv;

    // S = K Q^T and dP = V dO^T.
    TiledMmaNM mma_nm;
    auto thr_nm = mma_nm.get_thread_slice(thread_idx);
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor sDO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutDO{});
    Tensor tSrK = thr_nm.make_fragment_A(thr_nm.partition_A(sK));
    Tensor tSrQ = thr_nm.make_fragment_B(thr_nm.partition_B(sQ));
    Tensor tDPrV = thr_nm.make_fragment_A(thr_nm.partition_A(sV));
    Tensor tDPrDO = thr_nm.make_fragment_B(thr_nm.partition_B(sDO));

    // dV += P dO (P from registers), dK += dS Q (dS from shared memory).
    auto thr_nd = mma_nd.get_thread_slice(thread_idx);
    Tensor sDOp = make_tensor(make_smem_ptr(storage.smem_dop.data()), SmemLayoutDOp{});
    Tensor tDVrDO = thr_nd.make_fragment_B(thr_nd.partition_B(sDOp));
    Tensor sQp = make_tensor(make_smem_ptr(storage.smem_qp.data()), SmemLayoutQp{});
    Tensor tDKrQ = thr_nd.make_fragment_B(thr_nd.partition_B(sQp));

    // dQ = dS^T K over the CTA's K/V rows, half of it in each warpgroup
    // (TiledMmaDQ): both read both warpgroups' dS and K.
    TiledMmaDQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(wg * cutlass::NumThreadsPerWarpGroup + thread_idx);
    Tensor sDS = make_tensor(make_smem_ptr(storage.smem_ds.data()), SmemLayoutDS{});
    Tensor tDQrDS = thr_dq.make_fragment_A(thr_dq.partition_A(sDS));
    Tensor sKp = make_tensor(make_smem_ptr(storage.smem_kp.data()), SmemLayoutKp{});
    Tensor tDQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKp));
    Tensor sDQ = make_tensor(make_smem_ptr(storage.smem_dq.data()), SmemLayoutDQ{});
    auto tDQsDQ_full = thr_dq.partition_C(sDQ);

    // Per-row lse and delta', broadcast over the K/V rows.
    using NM = TileShapeNM;
    auto scalar_view = [&](float* ptr) {
      return make_tensor(make_smem_ptr(ptr),
                         make_shape(get<0>(NM{}), get<1>(NM{}), Int<StageCount>{}),
                         make_stride(_0{}, _1{}, get<1>(NM{})));
    };
    Tensor tSsLSE = thr_nm.partition_C(scalar_view(storage.smem_lse.data()));
    Tensor tDPsODO = thr_nm.partition_C(scalar_view(storage.smem_sumOdO.data()));

    Tensor cS = make_identity_tensor(take<0, 2>(NM{}));
    Tensor tScS = thr_nm.partition_C(cS);

    // dS^T in shared memory as the S tile's transpose.
    Tensor sDSt = sDS.compose(make_layout(make_shape(size<1>(sDS), size<0>(sDS), size<2>(sDS)),
                                          make_stride(size<0>(sDS), _1{}, size<1>(sDS) * size<0>(sDS))));
    Tensor tDPsDS = thr_nm.partition_C(sDSt);
    auto thr_nd_ss = TiledMmaND_SS{}.get_thread_slice(thread_idx);
    Tensor tDKrDSt = thr_nd_ss.make_fragment_A(thr_nd_ss.partition_A(sDSt));

    BwdWalk walk = make_walk(blk, p);
    const int k_token0 = walk.k_first() + wg * kWgRows;  // token of our first K/V row
    constexpr float kLog2e = float(M_LOG2E);
    int head, q_tile, q_first;
    bool masked, first = true;
    CUTLASS_PRAGMA_NO_UNROLL
    while (walk.next(head, q_tile, q_first, masked)) {
      pipeline.consumer_wait(read);
      PipelineState read_q = read;
      ++read;
      PipelineState read_do = read;
      ++read;

      Tensor acc_s = partition_fragment_C(mma_nm, take<0, 2>(NM{}));
      warpgroup_fence_operand(acc_s);
      warpgroup_arrive();
      fmha::gemm_zero_acc(mma_nm, tSrK(_, _, _, read_k.index()), tSrQ(_, _, _, read_q.index()), acc_s);
      warpgroup_commit_batch();

      pipeline.consumer_wait(read_do);
      Tensor acc_dp = partition_fragment_C(mma_nm, take<0, 2>(NM{}));
      warpgroup_fence_operand(acc_dp);
      warpgroup_arrive();
      fmha::gemm_zero_acc(mma_nm, tDPrV(_, _, _, read_v.index()), tDPrDO(_, _, _, read_do.index()), acc_dp);
      warpgroup_commit_batch();

      Tensor lse = make_fragment_like<float>(acc_s);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(lse); ++i) lse(i) = kLog2e * tSsLSE(_, _, _, read_q.index())(i);
      Tensor delta = make_fragment_like<float>(acc_s);  // delta' * scale
      auto load_delta = [&] {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(delta); ++i)
          delta(i) = p.scale_softmax * tDPsODO(_, _, _, read_do.index())(i);
      };
      if constexpr (kTileQ != 128) load_delta();  // as the example: early where registers allow

      warpgroup_wait<1>();  // S; and every earlier batch, the previous tile's dK
      warpgroup_fence_operand(acc_s);
      if (q_pending) pipeline.consumer_release(pending_q);
      order.wait();
      if (masked) mask_future(acc_s, tScS, k_token0, q_first);
      Tensor acc_p = make_fragment_like<float>(acc_s);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_p); ++i) acc_p(i) = exp2_ftz(p.scale_softmax_log2 * acc_s(i) - lse(i));
      order.arrive();
      if constexpr (kTileQ == 128) load_delta();

      // dV += P dO (P from registers). Where registers allow (64-row query
      // tiles) it is issued before dS is computed, so it runs meanwhile; at
      // 128 rows P's element-type copy beside dS spills (ptxas, nvcc 13.0).
      auto issue_dv = [&] {
        auto op_p = fmha::make_acc_into_op<Element>(acc_p, typename TiledMmaND::LayoutA_TV{});
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(op_p);
        warpgroup_arrive();
        cute::gemm(mma_nd, op_p, tDVrDO(_, _, _, read_do.index()), acc_dv);
        warpgroup_commit_batch();
      };
      constexpr bool kEarlyDv = kTileQ != 128;
      if constexpr (kEarlyDv) issue_dv();

      warpgroup_wait<kEarlyDv ? 1 : 0>();  // dP (dV may still run)
      warpgroup_fence_operand(acc_dp);
      Tensor acc_ds = make_fragment_like<Element>(acc_dp);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_ds); ++i)
        acc_ds(i) = Element(acc_p(i) * fmaf(acc_dp(i), p.scale_softmax, -delta(i)));
      if constexpr (!kEarlyDv) issue_dv();

      // dS into shared memory, transposed, 32 bits (two elements) per store,
      // once the other warpgroup's dQ GEMM has read this warpgroup's last dS.
      if (!first) DsBarrier::sync_read_by_other(wg);
      first = false;
      auto tDPsDS_v = recast<uint32_t>(tDPsDS);
      auto acc_ds_v = recast<uint32_t>(acc_ds);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_ds_v); ++i) tDPsDS_v(_, _, _, wg)(i) = acc_ds_v(i);
      cutlass::arch::fence_view_async_shared();
      DsBarrier::sync_stored();  // both warpgroups' dS is in shared memory

      // dQ (this warpgroup's half) over both warpgroups' K rows, then dK +=
      // dS^T Q (this warpgroup's 64 K rows), both asynchronously.
      Tensor acc_dq = partition_fragment_C(mma_dq, take<0, 2>(TileShapeMD{}));
      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      fmha::gemm_zero_acc(mma_dq, tDQrDS(_, _, _, 0), tDQrK(_, _, _, k_stage<0>()), acc_dq);
      cute::gemm(mma_dq, tDQrDS(_, _, _, 1), tDQrK(_, _, _, k_stage<1>()), acc_dq);
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc_dk);
      warpgroup_arrive();
      cute::gemm(TiledMmaND_SS{}, tDKrDSt(_, _, _, wg), tDKrQ(_, _, _, read_q.index()), acc_dk);
      warpgroup_commit_batch();

      warpgroup_wait<1>();  // dQ (dK may still run)
      warpgroup_fence_operand(acc_dq);
      DsBarrier::arrive_read(wg);  // the other warpgroup may overwrite its dS

      // dQ to a reducer stage (each warpgroup its half; the reducer pipeline
      // counts both arrivals); the reducer warp adds it into global dq.
      pipeline_red.producer_acquire(write_red);
      store_pairs_shared(acc_dq, tDQsDQ_full(_, _, _, write_red.index()), storage.smem_dq.data());
      cutlass::arch::fence_view_async_shared();
      pipeline_red.producer_commit(write_red);
      ++write_red;

      pipeline.consumer_release(read_do);  // dO and delta': both GEMMs reading dO are done
      pending_q = read_q;                  // Q and lse: at the next tile's first wait
      q_pending = true;
    }

    if (!first) DsBarrier::sync_read_by_other(wg);  // pairs the other's last arrival
    pipeline_kv.consumer_release(read_k);
    pipeline_kv.consumer_release(read_kv);
    pipeline_red.producer_tail(write_red);
    ++read_kv;

    warpgroup_wait<0>();
    if (q_pending) pipeline.consumer_release(pending_q);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(acc_dv);
    return make_tuple(acc_dk, acc_dv);
  }
};

}  // namespace pk::attention_bwd
