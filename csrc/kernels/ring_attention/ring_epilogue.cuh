// The ring attention kernel's epilogue: each math warpgroup writes its 64
// query rows: the log-sum-exp by plain stores, O converted to the element
// type in the warpgroup's own Q stage of shared memory (free once its last
// QK GEMM is done) and stored by one TMA store, whose wait ends as soon as
// the TMA unit has read the shared memory. O's strides are 64-bit: its batch
// stride s_local * Hq * D reaches 2^31 elements at sizes a GPU holds.
#pragma once

#include <cstdint>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "collective/fmha_common.hpp"

namespace pk::ring_attention {

// O [B, S, H, D]: (seq, dim, (batch, head)) strides; lse [B, H, S]: (seq,
// (batch, head)).
using StrideO = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, int64_t>>;
using StrideLse = cute::tuple<cute::_1, cute::tuple<int64_t, int64_t>>;

// kOwnBuffer (persistent CTAs): O's shared memory is its own, not the Q
// stage, and a tile's TMA store is waited for only before the next tile's O
// goes into the buffer (and once more as the CTA ends: finish()).
template <class Element, class ElementAccumulator, class TileShape_WG, bool kOwnBuffer = false>
struct RingEpilogue {
  static constexpr bool kOwnSharedMemory = kOwnBuffer;
  static constexpr int kRows = cute::get<0>(TileShape_WG{});  // one math warpgroup's query rows
  static constexpr int kDim = cute::get<1>(TileShape_WG{});   // head dim

  // O of one warpgroup in shared memory, 128-byte swizzled rows as the TMA
  // store reads them. The kernel (fwd_kernel.cuh) overlays warpgroup w's
  // TensorStorage on the mainloop's storage at w times its size: Q's stage w
  // (AttentionKernel checks the sizes).
  using SmemLayoutO = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kRows>{}, cute::Int<kDim>{})));
  struct TensorStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutO>> smem_o;
  };

  // O [B, S, H, D] as (seq, dim, (batch, head)).
  static auto o_tensor(Element* ptr, int seq, int batch, int heads, StrideO const& d) {
    return cute::make_tensor(cute::make_gmem_ptr(ptr),
                             cute::make_shape(seq, cute::Int<kDim>{}, cute::make_shape(batch, heads)),
                             d);
  }
  using TmaStoreO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{}, o_tensor(nullptr, 1, 1, 1, StrideO{}), SmemLayoutO{}));

  struct Arguments {
    Element* ptr_O;
    StrideO dO;
    ElementAccumulator* ptr_LSE;
    StrideLse dLSE;
  };

  struct Params {
    ElementAccumulator* ptr_LSE;
    StrideLse dLSE;
    TmaStoreO tma_store_o;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, Arguments const& args,
                                        void* = nullptr) {
    using namespace cute;
    auto o = o_tensor(args.ptr_O, get<2>(problem_size), get<0>(problem_size),
                      get<1>(problem_size), args.dO);
    return Params{args.ptr_LSE, args.dLSE, make_tma_copy(SM90_TMA_STORE{}, o, SmemLayoutO{})};
  }

  // As the CTA ends: its last TMA store has read the shared memory.
  CUTLASS_DEVICE static void finish() {
    if constexpr (kOwnBuffer)
      if (threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0) cute::tma_store_wait<0>();
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_store_o.get_tma_descriptor());
  }

  // Named barriers of the two math warpgroups' epilogues (CUTLASS reserves
  // the ids below FirstUserBarrier).
  static constexpr uint32_t kBarrier =
      uint32_t(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);

  // One warpgroup's tile: the log-sum-exp by plain stores of the threads
  // holding each row's first column; O converted into the warpgroup's shared
  // memory, then one TMA store, waited for only until it has read the
  // shared memory.
  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma,
            class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const& tile_shape, BlkCoord const& blk_coord,
                                 ResultTuple const& result, TiledMma const& tiled_mma,
                                 ProblemShape const& problem_size, Params const& params,
                                 TensorStorage& storage) {
    using namespace cute;
    using X = Underscore;
    using cutlass::fmha::collective::layout_acc_mn;

    auto const& acc = get<0>(result);
    auto const& lse = get<1>(result);
    const int thread = int(threadIdx.x % cutlass::NumThreadsPerWarpGroup);
    auto thr_mma = tiled_mma.get_thread_slice(thread);

    const int seqlen_q = get<2>(problem_size);
    const int num_batch = get<0>(problem_size);
    const int num_heads = get<1>(problem_size);
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
        if (get<0>(tOcO_mn(i)) + get<0>(blk_coord) * get<0>(tile_shape) < seqlen_q) {
          tOgLSE_mn(i, _0{}) = lse(i);
        }
      }
    }

    // O: registers -> shared memory -> one TMA store of the warpgroup's rows.
    Tensor sO = make_tensor(make_smem_ptr(storage.smem_o.data()), SmemLayoutO{});
    Tensor tOsO = thr_mma.partition_C(sO);
    Tensor o = make_fragment_like<Element>(tOsO);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) o(i) = Element(acc(i));
    const uint32_t wg = uint32_t(get<0>(blk_coord) % 2);
    if constexpr (kOwnBuffer) {  // the previous tile's store has read the buffer
      if (thread == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrier + wg);
    }
    copy(AutoVectorizingCopyWithAssumedAlignment<32>{}, o, tOsO);  // column pairs
    cutlass::arch::fence_view_async_shared();  // the writes, visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrier + wg);
    if (thread == 0) {
      Tensor mO = params.tma_store_o.get_tma_tensor(
          make_shape(seqlen_q, Int<kDim>{}, make_shape(num_batch, num_heads)));
      Tensor gO = local_tile(mO(_, _, get<2>(blk_coord)), take<0, 2>(tile_shape),
                             make_coord(get<0>(blk_coord), _0{}));
      auto cta_tma = params.tma_store_o.get_slice(_0{});
      copy(params.tma_store_o, cta_tma.partition_S(sO), cta_tma.partition_D(gO));
      tma_store_arrive();
      // The shared memory read (the writes finish on their own); with a buffer
      // of its own, not until the next tile needs it.
      if constexpr (!kOwnBuffer) tma_store_wait<0>();
    }
  }
};

}  // namespace pk::ring_attention
