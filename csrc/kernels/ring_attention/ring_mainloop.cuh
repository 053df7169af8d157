// The attention mainloop of the fused ring kernel.
//
// It reuses the building blocks of CUTLASS's Hopper FMHA (the nvidia-cutlass
// wheel ships them under examples/88_hopper_fmha): the TMA warp-specialized
// mainloop's types, shared storage and pipelines and its online softmax; the
// kernel around it (fwd_kernel.cuh) and the epilogue (ring_epilogue.cuh) are
// pk's. What changes is the K/V loop:
//   * the producer and the two math warpgroups follow one KvWalk (kv_walk.cuh)
//     over the whole ring instead of one local sequence: our own block first,
//     then each peer's block from the workspace;
//   * before the first TMA load of a peer's block, the producer lane waits
//     until that peer's copy engine has posted it (a bounded spin on a flag
//     in our own memory), so compute starts on local data at once and the
//     partial results of all ring steps merge in registers;
//   * causal masks compare global token positions (both layouts), and tiles
//     wholly in the future are never loaded;
//   * key tiles need not divide a chunk: each chunk's last tile is loaded
//     from the chunk's end and its keys the tile before it covered are
//     masked (kv_walk.cuh), so TMA loads start at any row;
//   * a CTA one of whose waits failed, or that began while the device held
//     an error, writes NaN: a failed call's output is poison.
// GQA/MQA: query head h reads K/V head h / group.
#pragma once

#include <cmath>

#include "collective/fmha_collective_tma_warpspecialized.hpp"
#include "collective/fmha_fusion.hpp"

#include "kernels/common/fast_math.cuh"
#include "kernels/ring_attention/kv_walk.cuh"
#include "pk/layout.h"
#include "pk/sync.cuh"

namespace pk::ring_attention {

using namespace cute;
namespace fmha = cutlass::fmha::collective;

// Everything about the ring the mainloop needs besides the tensors.
struct RingArgs {
  Geometry geo;
  int group = 1;                     // query heads per K/V head
  int kv_heads = 1;
  const uint64_t* posted = nullptr;  // our channel flags' posted[] (peers write)
  const uint64_t* epoch = nullptr;   // our channel's completed-call count
  WaitContext wait{};
  float scale = 1.0f;
  PiecePlan plan{};                  // how each peer's block is cut into posted pieces
};

// The unit of a TMA coordinate tensor's mode whose stride is `step` units of
// one basis (a tile mode: kTileK keys a step), e.g. E<1> for 128 E<1>; the
// key mode is TMA dimension 1 for K and V alike, not the tensor's mode.
template <int kStep, class T, int... Ns>
CUTLASS_DEVICE constexpr auto unit_basis(cute::ScaledBasis<T, Ns...>) {
  static_assert(cute::is_static<T>::value && T::value == kStep,
                "the tile mode advances kStep units of one coordinate");
  return cute::E<Ns...>{};
}

// Tile: the CTA's tile and mainloop variant (attention_sm90.cuh, FwdTile):
// Shape (query rows, keys, head dim), the example's K/V stages option,
// kLazyRescale (online_softmax) and kRescaleUnderQk (compute).
template <class Element, class Tile, class Stride>
struct RingMainloop
    : cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
          Element, float, float, typename Tile::Shape, Stride, Stride, Stride,
          cutlass::fmha::collective::DefaultFusion, typename Tile::StagesKV> {
  using Base = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
      Element, float, float, typename Tile::Shape, Stride, Stride, Stride,
      cutlass::fmha::collective::DefaultFusion, typename Tile::StagesKV>;
  using TileShape = typename Tile::Shape;
  using typename Base::CollectiveMmaPV;
  using typename Base::CollectiveMmaQK;
  using typename Base::LoadK;
  using typename Base::LoadQ;
  using typename Base::LoadV;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::TiledMmaPV;
  using typename Base::TiledMmaQK;
  using typename Base::TileShapePV;
  using typename Base::TileShapeQK;
  using typename Base::TMA_K;
  using typename Base::TMA_V;
  using Base::NumMmaWarpGroups;
  // Persistent CTAs (FwdTile's kPersistentCtas): each warpgroup gives its Q
  // stage back after its tile's last QK GEMM, and the producer issues a
  // tile's first K/V before its Q from the CTA's second tile on.
  static constexpr bool kPersistent = Tile::kPersistentCtas;
  static constexpr bool kLazyRescale = Tile::kLazyRescale;
  static constexpr bool kRescaleUnderQk = Tile::kRescaleUnderQk;
  static constexpr bool kDoubleBufferP = Tile::kDoubleBufferP;

  static constexpr int kTileQ = get<0>(TileShape{});
  static constexpr int kTileK = get<1>(TileShape{});

  struct Arguments {
    const Element* q;
    Stride dq;
    const Element* k;        // our block [B, s_local, Hkv, D]
    const Element* v;
    Stride dkv;
    const Element* k_peers;  // peers' blocks [B, (n - 1) * s_local, Hkv, D], slot s - 1
    const Element* v_peers;  // for ring step s
    Stride dkv_peers;
    RingArgs ring;
  };

  struct Params : Base::Params {
    TMA_K tma_load_k_peers;
    TMA_V tma_load_v_peers;
    RingArgs ring;
  };

  // Problem shapes as the FMHA collectives read them: (B, H, Sq, Skv, D).
  using Problem = cute::tuple<int, int, int, int, int>;

  template <class ProblemShape>
  CUTLASS_HOST_DEVICE static Problem kv_problem(ProblemShape const& p, RingArgs const& r, int kv_rows) {
    return Problem{get<0>(p), r.kv_heads, get<2>(p), kv_rows, get<4>(p)};
  }

  // TMA descriptors of q (query heads) and of one K/V tensor (kv heads).
  static auto make_tmas(Problem const& pq, Problem const& pkv, Arguments const& a,
                        const Element* k, const Element* v, Stride const& dkv) {
    auto qk_shape = [](Problem const& p) {
      return make_shape(get<2>(p), get<3>(p), get<4>(p), make_shape(get<0>(p), get<1>(p)));
    };
    auto q_params = CollectiveMmaQK::to_underlying_arguments(
        qk_shape(pq), typename CollectiveMmaQK::Arguments{a.q, a.dq, a.k, a.dkv}, nullptr);
    auto k_params = CollectiveMmaQK::to_underlying_arguments(
        qk_shape(pkv), typename CollectiveMmaQK::Arguments{a.q, a.dq, k, dkv}, nullptr);
    auto v_params = CollectiveMmaPV::to_underlying_arguments(
        select<0, 2, 1, 3>(qk_shape(pkv)),
        typename CollectiveMmaPV::Arguments{k, dkv, v, select<1, 0, 2>(dkv)}, nullptr);
    return cute::make_tuple(q_params.tma_load_a, k_params.tma_load_b, v_params.tma_load_b);
  }

  // The head dim is the tile's; a chunk holds at least one key tile (the
  // walk places each chunk's last tile inside it).
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& a) {
    return get<4>(problem) == get<2>(TileShape{}) && a.ring.geo.chunk_rows() >= kTileK;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& a, void*) {
    const Geometry& g = a.ring.geo;
    const Problem pq{get<0>(problem), get<1>(problem), get<2>(problem), get<3>(problem),
                     get<4>(problem)};
    auto local = make_tmas(pq, kv_problem(problem, a.ring, g.s_local), a, a.k, a.v, a.dkv);
    // With one rank there are no peers' blocks; point the descriptors at ours.
    const bool peers = g.n > 1;
    auto remote = make_tmas(pq, kv_problem(problem, a.ring, peers ? (g.n - 1) * g.s_local : g.s_local),
                            a, peers ? a.k_peers : a.k, peers ? a.v_peers : a.v,
                            peers ? a.dkv_peers : a.dkv);
    Params p;
    p.tma_load_q = get<0>(local);
    p.tma_load_k = get<1>(local);
    p.tma_load_v = get<2>(local);
    p.tma_load_k_peers = get<1>(remote);
    p.tma_load_v_peers = get<2>(remote);
    p.scale_softmax = a.ring.scale;
    p.scale_softmax_log2 = float(a.ring.scale * M_LOG2E);
    p.rp_dropout = 1.0f;
    p.ring = a.ring;
    return p;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    Base::prefetch_tma_descriptors(p);
    cute::prefetch_tma_descriptor(p.tma_load_k_peers.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_v_peers.get_tma_descriptor());
  }

  // The walk of the CTA's query tile (blk_coord's first mode, kTileQ rows).
  template <class BlkCoord>
  CUTLASS_DEVICE static KvWalk make_walk(BlkCoord const& blk, Params const& p) {
    const Geometry& g = p.ring.geo;
    return KvWalk(g, g.token(g.rank, int(get<0>(blk)) * kTileQ), kTileQ, kTileK);
  }

  // ---- producer warp ------------------------------------------------------
  // Q, then the walk's K/V tiles. `wait_failed` (shared memory) becomes 1
  // when a wait for a peer's piece fails; the loads go on (the math
  // warpgroups then write poison, compute()).
  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE void load(BlkCoord const& blk, Params const& p, ProblemShape const& problem,
                           MainloopPipeline& pipeline, PipelineState& write,
                           MainloopPipelineQ& pipeline_q, PipelineStateQ& write_q,
                           SharedStorage& storage, int& wait_failed) {
    constexpr int block_rank_in_cluster = 0;
    const int lane_predicate = cute::elect_one_sync();
    const Geometry& g = p.ring.geo;
    const auto kv_blk = make_coord(get<0>(blk), get<1>(blk),
                                   make_coord(get<2, 0>(blk), get<2, 1>(blk) / p.ring.group));

    LoadQ load_q{p.tma_load_q, pipeline_q, storage.smem_q};
    auto q_state = load_q.init_state(_0{}, problem, TileShapeQK{}, blk, NumMmaWarpGroups);
    auto q_iter = cute::make_coord_iterator(Int<NumMmaWarpGroups>{});
    int q_count = NumMmaWarpGroups;

    const Problem own = kv_problem(problem, p.ring, g.s_local);
    const Problem peers = kv_problem(problem, p.ring, g.n > 1 ? (g.n - 1) * g.s_local : g.s_local);
    LoadK load_k{p.tma_load_k, pipeline, storage.smem_k};
    LoadV load_v{p.tma_load_v, pipeline, storage.smem_v};
    LoadK load_k_peers{p.tma_load_k_peers, pipeline, storage.smem_k};
    LoadV load_v_peers{p.tma_load_v_peers, pipeline, storage.smem_v};
    auto k_own = load_k.init_state(block_rank_in_cluster, own, TileShapeQK{}, kv_blk, 0);
    auto v_own = load_v.init_state(block_rank_in_cluster, own, TileShapePV{}, kv_blk, 0);
    auto k_peer = load_k_peers.init_state(block_rank_in_cluster, peers, TileShapeQK{}, kv_blk, 0);
    auto v_peer = load_v_peers.init_state(block_rank_in_cluster, peers, TileShapePV{}, kv_blk, 0);

    // One stage of the shared K/V pipeline, filled by one TMA load of the
    // tile whose first key is `key` keys into the tensor: the first tile's
    // coordinates moved by `key` units of the tile mode's coordinate (the
    // TMA tensor's own basis for the key mode: its stride is kTileK units of
    // it), so a tile may start at any row.
    auto issue = [&](auto const& tma, auto const& state, int key) {
      pipeline.producer_acquire(write);
      auto* bar = pipeline.producer_get_barrier(write);
      auto first = get<0>(state)(_, _, _, 0);
      const auto key_unit = unit_basis<kTileK>(stride<3>(get<0>(state)));
      copy(tma.with(*bar, 0), make_tensor(first.data() + key_unit * key, first.layout()),
           get<1>(state)(_, _, _, write.index()));
      ++write;
    };

    if (lane_predicate) {
      // This call's epoch, read at the first peer's tile: the read stays off
      // the path to Q's load (a ring of one never reads it). Calls before this
      // one on the stream have set it; none after it runs until it ends.
      uint64_t epoch = 0;
      const int pieces = p.ring.plan.pieces;
      int waited_step = 0, waited_piece = -1;  // the last piece known to be here
      // Q (both warpgroups' stages) before the walk's arithmetic: its rows
      // come from HBM (no other CTA reads them), the K/V tiles mostly from
      // L2, so Q's latency is the longer.
      // (Persistent CTAs after their first tile: Q after the first K/V pair,
      // as its stages free only once both warpgroups' last QK GEMM of the
      // tile before is done, while K/V stages free as that tile proceeds.)
      if (!kPersistent || write_q.count() == 0)
        while (q_count > 0) load_q.step(q_iter, q_state, write_q, lane_predicate, q_count);
      KvWalk walk = make_walk(blk, p);
      KvTile t;
      while (walk.next(t)) {
        // The walk visits a peer's rows in order and a piece holds
        // consecutive rows, so waiting for the piece of a tile's last row
        // covers the whole tile.
        const int piece = p.ring.plan.piece_of(t.row + kTileK - 1);
        if (t.step > 0 && (t.step != waited_step || piece > waited_piece)) {
          if (epoch == 0) epoch = *reinterpret_cast<const volatile uint64_t*>(p.ring.epoch) + 1;
          const int src = (g.rank - t.step + g.n) % g.n;
          const uint64_t target = (epoch - 1) * uint64_t(pieces) + piece + 1;
          if (!wait_geq(p.ring.posted + src, target, p.ring.wait, src, kWaitPiece))
            wait_failed = 1;  // before the next stage's arrive (release) publishes it
          // The copy engine wrote the rows; TMA reads them through the async proxy.
          asm volatile("fence.proxy.async.global;" ::: "memory");
          waited_step = t.step;
          waited_piece = piece;
        }
        const int key = t.step == 0 ? t.row : (t.step - 1) * g.s_local + t.row;
        if (t.step == 0) issue(p.tma_load_k, k_own, key);
        else issue(p.tma_load_k_peers, k_peer, key);
        if (t.step == 0) issue(p.tma_load_v, v_own, key);
        else issue(p.tma_load_v_peers, v_peer, key);
        while (q_count > 0) load_q.step(q_iter, q_state, write_q, lane_predicate, q_count);
      }
      while (q_count > 0) load_q.step(q_iter, q_state, write_q, lane_predicate, q_count);
    }
  }

  // Mask the scores a tile must not count: its first t.skip keys (the tile
  // before it covered them) and, causal, keys after their query (global
  // tokens).
  template <class Acc, class Coords>
  CUTLASS_DEVICE static void mask_tile(Acc& acc, Coords const& coords, int q_shift,
                                       KvTile const& t, bool causal) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      auto c = coords(i);
      const int key = int(get<1>(c));
      if (key < t.skip || (causal && t.token + key > int(get<0>(c)) + q_shift)) acc(i) = -INFINITY;
    }
  }

  // ---- math warpgroups ----------------------------------------------------
  // The online-softmax update for one tile's scores, in place: the running
  // row max m grows to cover the tile, the scores become exp2(k (s - m))
  // (k = scale * log2 e), and the running sum l is rescaled and extended.
  // Returns each row's factor exp2(k (m_old - m)) for O (exactly 1 where m
  // did not change), which the caller applies once the PV GEMM of the
  // previous tile has let go of O. Rows with nothing visible yet keep
  // m = -inf and contribute zeros. kLazyRescale: a row keeps its running max
  // while the tile's exceeds it by at most 8 in k units (probabilities up to
  // 2^8, which bf16, fp16 and the fp32 sums hold), so O is rescaled only when
  // a row's max grows by more; exact, as O and l share the max the
  // normalization and the log-sum-exp use.
  template <class AccQK, class State>
  CUTLASS_DEVICE static auto online_softmax(AccQK& acc_qk, State& state, float k) {
    TiledMmaQK mma_qk;
    Tensor s = make_tensor(acc_qk.data(), fmha::layout_acc_mn(mma_qk, acc_qk.layout()));
    auto red = fmha::reduction_target_n(mma_qk);
    constexpr int kRedRank = decltype(rank(red))::value;
    auto& m = get<0>(state);
    auto& l = get<1>(state);
    Tensor o_scale = make_fragment_like(m);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      float mx = m(i);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) mx = fmaxf(mx, s(i, j));
      // The row is spread over the threads of a quad: reduce across them.
      for_each(make_seq<kRedRank>{}, [&](auto r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 1; j < shape<r>(red); j *= 2)
          mx = fmaxf(mx, __shfl_xor_sync(uint32_t(-1), mx, stride<r>(red) * j));
      });
      if constexpr (kLazyRescale)
        if (m(i) != -INFINITY && (mx - m(i)) * k <= 8.f) mx = m(i);
      const float base = mx == -INFINITY ? 0.f : mx * k;
      // m(i) = -inf on a row's first visible tile: 0
      o_scale(i) = mx == m(i) ? 1.f : exp2_ftz(m(i) * k - base);
      m(i) = mx;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        s(i, j) = exp2_ftz(s(i, j) * k - base);
        sum += s(i, j);
      }
      l(i) = l(i) * o_scale(i) + sum;
    }
    return o_scale;
  }

  // kLazyRescale: nothing to do where every factor is 1.
  template <class AccPV, class Scale>
  CUTLASS_DEVICE static void rescale(AccPV& acc_pv, Scale const& o_scale) {
    if constexpr (kLazyRescale) {
      bool any = false;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(o_scale); ++i) any |= o_scale(i) != 1.f;
      if (!any) return;
    }
    TiledMmaPV mma_pv;
    Tensor o = make_tensor(acc_pv.data(), fmha::layout_acc_mn(mma_pv, acc_pv.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(o); ++i)
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(o); ++j) o(i, j) *= o_scale(i);
  }

  // Software-pipelined per warpgroup: while the tensor cores run the PV GEMM
  // of tile t - 1 (asynchronous wgmma), the warpgroup computes the softmax
  // of tile t, whose QK GEMM was issued just before it. K and V stages
  // alternate in the shared pipeline; K_t is consumed before V_{t-1}, so each
  // has its own read state (two stages per tile).
  // `wait_failed`: the producer's flag (load()).
  template <class BlkCoord, class ProblemShape, class OrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk, BlkCoord const& wg_coord, Params const& p,
                              ProblemShape const&, MainloopPipeline& pipeline,
                              PipelineState& read, MainloopPipelineQ& pipeline_q,
                              PipelineStateQ& read_q, int const& wait_failed,
                              SharedStorage& storage, OrderBarrier& order) {
    // An error the device held when this tile began (an earlier call's or
    // another CTA's failed wait), read now so that its latency hides under
    // the tile's GEMMs rather than before the epilogue.
    const bool failed_before = device_failed(p.ring.wait);
    const int thread_idx = int(threadIdx.x);
    PipelineState read_k = read;
    PipelineState read_v = read;
    ++read_v;
    auto next_tile = [](PipelineState& st) { ++st, ++st; };

    TiledMmaQK mma_qk;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Base::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Base::SmemLayoutK{});
    Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ));
    Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK));
    TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Base::SmemLayoutV{});
    Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV));

    // (query row in our block, key column in the tile) of each score.
    const int wg_row0 = int(get<0>(wg_coord)) * get<0>(TileShapeQK{});
    Tensor cP = make_identity_tensor(take<0, 2>(TileShapeQK{}));
    Tensor tPcP = thr_qk.partition_C(cP);
    tPcP.data() = tPcP.data() + E<0>{} * wg_row0;
    const Geometry& g = p.ring.geo;
    const int q_shift = g.token(g.rank, wg_row0) - wg_row0;  // row -> global token
    const float k2 = p.scale_softmax_log2;

    Tensor acc_pv = partition_fragment_C(mma_pv, take<0, 2>(TileShapePV{}));
    cutlass::fmha::collective::CollectiveSoftmax<float, cutlass::fmha::collective::DefaultFusion,
                                                 Params>
        softmax{p};  // its tail() normalizes O and forms the log-sum-exp
    auto state = softmax.init(acc_pv, mma_pv);
    fill(get<0>(state), -INFINITY);
    fill(get<1>(state), 0.f);
    clear(acc_pv);

    // S = Q K^T of the next K stage, issued asynchronously.
    auto issue_qk = [&](auto& acc_qk) {
      pipeline.consumer_wait(read_k);
      warpgroup_fence_operand(acc_qk);
      warpgroup_arrive();
      fmha::gemm_zero_acc(mma_qk, tSrQ(_, _, _, read_q.index()), tSrK(_, _, _, read_k.index()),
                          acc_qk);
      warpgroup_commit_batch();
    };

    KvWalk walk = make_walk(blk, p);
    KvTile t;
    walk.next(t);  // never empty: the query tile's own chunk is visible
    pipeline_q.consumer_wait(read_q);

    // Tile 0: scores and probabilities; its PV GEMM waits for the loop.
    Tensor acc_qk = partition_fragment_C(mma_qk, take<0, 2>(TileShapeQK{}));
    order.wait();
    issue_qk(acc_qk);
    order.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_qk);
    pipeline.consumer_release(read_k);
    next_tile(read_k);
    if (t.masked) mask_tile(acc_qk, tPcP, q_shift, t, g.causal);
    auto o_scale = online_softmax(acc_qk, state, k2);  // O is zero: nothing to rescale
    Tensor p_op = fmha::make_acc_into_op<Element>(acc_qk, typename TiledMmaPV::LayoutA_TV{});

    // O += P V of the previous tile (its probabilities in p).
    auto issue_pv = [&](auto& p) {
      pipeline.consumer_wait(read_v);
      warpgroup_fence_operand(acc_pv);
      warpgroup_fence_operand(p);
      warpgroup_arrive();
      cute::gemm(mma_pv, p, tOrV(_, _, _, read_v.index()), acc_pv);
      warpgroup_commit_batch();
    };

    if constexpr (kDoubleBufferP) {
      // P in two register buffers, taken in turns: tile t's probabilities
      // go to the buffer the PV GEMM of tile t - 2 read (finished), so the
      // softmax never waits for the PV GEMM of tile t - 1, which runs beside
      // it, and the next QK GEMM queues behind that PV GEMM. O's rescale
      // waits for the PV GEMM of tile t - 2 instead (issued a tile earlier).
      Tensor p_other = p_op;  // same type; overwritten before its first read
      bool pv_pending = false;  // a PV GEMM whose V stage is not yet released
      // After the wait for the last PV GEMM issued: its V stage back, O
      // rescaled, then O += P V of the tile whose probabilities p holds.
      auto rescale_and_issue_pv = [&](auto& p) {
        warpgroup_fence_operand(acc_pv);
        if (pv_pending) {
          pipeline.consumer_release(read_v);
          next_tile(read_v);
        }
        rescale(acc_pv, o_scale);
        issue_pv(p);
        pv_pending = true;
      };
      auto step = [&](auto& p_prev, auto& p_next) {
        Tensor acc_qk = partition_fragment_C(mma_qk, take<0, 2>(TileShapeQK{}));
        issue_qk(acc_qk);
        warpgroup_wait<1>();  // the PV GEMM of tile t - 2 (older than this QK)
        rescale_and_issue_pv(p_prev);
        warpgroup_wait<1>();  // this tile's QK
        warpgroup_fence_operand(acc_qk);
        pipeline.consumer_release(read_k);
        next_tile(read_k);
        if (t.masked) mask_tile(acc_qk, tPcP, q_shift, t, g.causal);
        o_scale = online_softmax(acc_qk, state, k2);
        p_next = fmha::make_acc_into_op<Element>(acc_qk, typename TiledMmaPV::LayoutA_TV{});
      };
      // Tile 0's P is in p_op; after each step the last tile's is in the
      // other buffer. The last tile's PV GEMM is issued here.
      CUTLASS_PRAGMA_NO_UNROLL
      while (true) {
        if (!walk.next(t)) {
          warpgroup_wait<0>();
          rescale_and_issue_pv(p_op);
          break;
        }
        step(p_op, p_other);
        if (!walk.next(t)) {
          warpgroup_wait<0>();
          rescale_and_issue_pv(p_other);
          break;
        }
        step(p_other, p_op);
      }
    } else {
      CUTLASS_PRAGMA_NO_UNROLL
      while (walk.next(t)) {
        Tensor acc_qk = partition_fragment_C(mma_qk, take<0, 2>(TileShapeQK{}));
        issue_qk(acc_qk);
        // kRescaleUnderQk: O takes the previous tile's factor while the tensor
        // cores run this tile's QK (FA3's order), not between the PV wait and
        // the next GEMM issue.
        if constexpr (kRescaleUnderQk) rescale(acc_pv, o_scale);
        issue_pv(p_op);
        warpgroup_wait<1>();  // this tile's QK (the older batch) is done
        warpgroup_fence_operand(acc_qk);
        pipeline.consumer_release(read_k);
        next_tile(read_k);
        if (t.masked) mask_tile(acc_qk, tPcP, q_shift, t, g.causal);
        o_scale = online_softmax(acc_qk, state, k2);
        warpgroup_wait<0>();  // the previous tile's PV: O and P are free
        warpgroup_fence_operand(acc_pv);
        pipeline.consumer_release(read_v);
        next_tile(read_v);
        if constexpr (!kRescaleUnderQk) rescale(acc_pv, o_scale);
        p_op = fmha::make_acc_into_op<Element>(acc_qk, typename TiledMmaPV::LayoutA_TV{});
      }
      if constexpr (kRescaleUnderQk) rescale(acc_pv, o_scale);
      issue_pv(p_op);  // the last tile's
    }
    // The last tile's PV GEMM, then its V stage back.
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_pv);
    pipeline.consumer_release(read_v);
    next_tile(read_v);
    read = read_k;  // past every stage this CTA consumed (K_t at 2t, V_t at 2t + 1)
    // Every QK GEMM of this tile is done: the producer may load the next
    // tile's Q into this warpgroup's stage.
    if constexpr (kPersistent) pipeline_q.consumer_release(read_q);

    Tensor lse = softmax.tail(state, acc_pv, mma_pv);
    // A failed call's tile is poison (NaN in O and the log-sum-exp): a wait
    // of this CTA's producer failed (it set the flag before the arrive of a
    // stage consumed since) or the device held an error when the tile began.
    // Other CTAs' waits failing meanwhile leave this tile's data whole.
    if (failed_before || *reinterpret_cast<const volatile int*>(&wait_failed) != 0) {
      const float nan = __int_as_float(0x7fc00000);
      fill(acc_pv, nan);
      fill(lse, nan);
    }
    return make_tuple(acc_pv, lse);
  }
};

}  // namespace pk::ring_attention
