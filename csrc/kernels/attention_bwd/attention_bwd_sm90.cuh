// The block backward kernel for one (element type, head dim): BlockBwdKernel
// (bwd_kernel.cuh: one load warpgroup, two cooperative math warpgroups)
// around BwdMainloop, with our scheduler and a dK/dV epilogue (fp32, or the
// input type for a block that needs no sum).
//
// Launch config: one CTA per (128-row K/V tile, batch, K/V head), 384
// threads, head by head, or under a causal mask K/V tile by K/V tile (the
// earliest keys see the most queries: the longest CTAs start first;
// KvTileScheduler); dynamic shared memory Kernel::SharedStorageSize (about
// 200 KiB).
// Arguments: attention_bwd.h's Params, turned into Kernel::Arguments below.
// Roles: warpgroup 0: warp 0 adds dQ tiles into global dq (TMA reduce-add),
//   warp 1 loads K/V once and Q, lse, dO, delta' per visible query tile;
//   warpgroups 1 and 2 each own 64 K/V rows: S, dP, P, dS, dV and dK
//   (registers), and each computes half of the tile's dQ over the CTA's
//   128 K/V rows (along the head dim at 64-row query tiles, along the query
//   rows at 128).
// Entry point: Variant<type, head dim>::launch (attention_bwd.h).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <type_traits>

#include "kernels/attention_bwd/attention_bwd.h"
#include "kernels/attention_bwd/bwd_kernel.cuh"
#include "kernels/attention_bwd/bwd_mainloop.cuh"
#include "kernels/common/cutlass_type.cuh"
#include "kernels/common/fmha_launch.cuh"
#include "pk/sync.cuh"

namespace pk::attention_bwd {

// One CTA per (K/V tile, batch, K/V head) on a 1-D grid, in one of two
// launch orders. Head by head (CTA i: tile i % tiles of (batch, head)
// i / tiles), for blocks whose tiles are the same work (no mask: 2% faster
// on one H200 than the other order). Under a causal mask, where a K/V tile's
// work (the query tiles it sees) falls as its index grows in contiguous and
// zigzag blocks alike, K/V tile by K/V tile within groups of kGroupPairs
// (batch, head) pairs (CTA i of a group of n pairs: tile i / n of the
// group's pair i % n): longest first, the short tiles fill each group's last
// wave (fwd+bwd 5-6% faster at s8192 with 16 heads, one group), while the
// CTAs at work share a group's Q, dO and fp32 dq in L2 (one order over all
// pairs spread b8 s2048 h16's 132 CTAs over 128 pairs: 134 MB of dq; in
// groups its forward + backward ran 1.24x faster on one H200). Block
// coordinates as the example's backward: (_, K/V tile, (b, h)).
struct KvTileScheduler {
  static constexpr int kGroupPairs = 16;
  struct Params {
    dim3 grid;
    int batch;     // B
    int heads;     // Hkv
    int kv_tiles;  // per (batch, head)
    bool longest_first = false;  // grouped K/V tile by K/V tile (set at launch: causal)
  };
  int kv_tile, b, h;
  bool valid = true;

  CUTLASS_DEVICE explicit KvTileScheduler(Params const& p) {
    const int i = int(blockIdx.x);
    const int pairs = p.batch * p.heads;
    int pair;
    if (p.longest_first) {
      const int group = i / (kGroupPairs * p.kv_tiles);
      const int first = group * kGroupPairs;                           // the group's first pair
      const int n = pairs - first < kGroupPairs ? pairs - first : kGroupPairs;  // its pairs
      const int r = i - first * p.kv_tiles;                            // CTA in the group
      kv_tile = r / n;
      pair = first + r % n;
    } else {
      pair = i / p.kv_tiles;
      kv_tile = i % p.kv_tiles;
    }
    b = pair % p.batch;
    h = pair / p.batch;
  }

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo,
                                        ClusterShape const&, TileShape const& tile) {
    const int kv_tiles = cute::ceil_div(cute::get<3>(problem), cute::get<1>(tile));
    const int batch = cute::get<0>(problem), heads = cute::get<1>(problem);
    return Params{dim3(unsigned(kv_tiles) * unsigned(batch) * unsigned(heads)), batch, heads,
                  kv_tiles};
  }
  static dim3 get_grid_shape(Params const& p) { return p.grid; }
  CUTLASS_DEVICE bool is_valid() const { return valid; }
  CUTLASS_DEVICE auto get_block_coord() const {
    return cute::make_coord(cute::_0{}, kv_tile, cute::make_coord(b, h));
  }
  CUTLASS_DEVICE KvTileScheduler& operator++() {
    valid = false;
    return *this;
  }
};

// dK and dV of one math warpgroup's 64 rows straight from the accumulators
// into [B, T, Hkv, D] (each CTA owns its rows: plain stores of two adjacent
// columns, 8 bytes as fp32, 4 in the input type). No shared memory, no
// pipeline. NaN instead while the device holds an error (`claim`, see Params).
template <class Element, class TileShapeND, class TiledMma>
struct KvGradEpilogue {
  struct Arguments {
    void* dk;
    void* dv;
    bool in_input_type;  // Element instead of fp32
    const int32_t* claim;
  };
  using Params = Arguments;
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }

  // `wg_coord`: (_, the warpgroup's 64-row block, (b, h)); `result`: its
  // (dK, dV) accumulators.
  template <class BlkCoord, class Result, class ProblemShape>
  CUTLASS_DEVICE void operator()(BlkCoord const& wg_coord, Result const& result,
                                 ProblemShape const& problem, Params const& p) {
    using namespace cute;
    TiledMma mma;
    const int t_rows = get<3>(problem), heads = get<1>(problem);
    constexpr int kRows = get<0>(TileShapeND{});
    constexpr int kDim = get<1>(TileShapeND{});
    const int b = get<2, 0>(wg_coord), h = get<2, 1>(wg_coord);
    const int row0 = int(get<1>(wg_coord)) * kRows;
    auto thr = mma.get_thread_slice(int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup);
    Tensor coords = thr.partition_C(make_identity_tensor(make_shape(Int<kRows>{}, Int<kDim>{})));
    const bool failed = device_failed(p.claim);
    const float nan = __int_as_float(0x7fc00000);
    auto store = [&](auto const& acc, void* base, auto elem) {
      using T = decltype(elem);
      using Pair = std::conditional_t<std::is_same_v<T, float>, float2, cutlass::Array<T, 2>>;
      static_assert(size(decltype(acc){}) % 2 == 0);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); i += 2) {
        auto c = coords(i);  // accumulator pairs are adjacent columns
        const int row = row0 + int(get<0>(c));
        const size_t at = ((size_t(b) * t_rows + row) * heads + h) * kDim + int(get<1>(c));
        const float x = failed ? nan : acc(i), y = failed ? nan : acc(i + 1);
        Pair v;
        if constexpr (std::is_same_v<T, float>) {
          v = make_float2(x, y);
        } else {
          v[0] = T(x);
          v[1] = T(y);
        }
        *reinterpret_cast<Pair*>(static_cast<T*>(base) + at) = v;
      }
    };
    if (p.in_input_type) {
      store(get<0>(result), p.dk, Element{});
      store(get<1>(result), p.dv, Element{});
    } else {
      store(get<0>(result), p.dk, float{});
      store(get<1>(result), p.dv, float{});
    }
  }
};

// Tiles as CUTLASS's example picks them for its backward: (query rows, K/V
// rows, head dim).
template <int kHeadDim>
struct BwdTiles;
template <>
struct BwdTiles<128> {
  using Shape = cute::Shape<cute::_64, cute::_128, cute::_128>;
};
template <>
struct BwdTiles<64> {
  using Shape = cute::Shape<cute::_128, cute::_128, cute::_64>;
};

template <typename Element, int kHeadDim>
struct BwdKernel {
  using TileShape = typename BwdTiles<kHeadDim>::Shape;
  using Mainloop = BwdMainloop<Element, TileShape>;
  using Epilogue = KvGradEpilogue<Element, typename Mainloop::TileShapeND,
                                  typename Mainloop::TiledMmaND>;
  using Kernel = BlockBwdKernel<Mainloop, Epilogue, KvTileScheduler>;
  static_assert(cute::get<0>(TileShape{}) == tile_q(kHeadDim), "host checks use tile_q()");
  static_assert(cute::get<1>(TileShape{}) == kTileKv, "host checks use kTileKv");
  static_assert(Kernel::SharedStorageSize <= 227 * 1024, "shared memory of one SM");

  // (batch, head, row, 1) strides of [B, rows, heads, D], 64-bit.
  static typename Mainloop::Stride4 stride(int rows, int heads) {
    const auto s = ring_attention::TensorStrides::of(rows, heads, kHeadDim);
    return {s.batch, s.head, s.row, cute::_1{}};
  }

  static typename Kernel::Arguments arguments(const Params& p) {
    const int group = p.q_heads / p.kv_heads;
    BwdArgs bwd{p.n, p.s_q, p.s_kv, p.zigzag, p.causal, group, p.scale, p.q_rank, p.k_rank};
    return typename Kernel::Arguments{
        {p.batch, p.kv_heads, p.s_q, p.s_kv, kHeadDim},
        {static_cast<const Element*>(p.q), stride(p.s_q, p.q_heads),
         static_cast<const Element*>(p.k), stride(p.s_kv, p.kv_heads),
         static_cast<const Element*>(p.v), static_cast<const Element*>(p.dout), p.lse,
         typename Mainloop::Stride3{int64_t(p.q_heads) * p.s_q, int64_t(p.s_q), cute::_1{}},
         p.delta, p.dq,
         stride(p.s_q, p.q_heads), bwd},
        {p.dk, p.dv, p.dkv_in_input_type, p.claim},
        cutlass::KernelHardwareInfo{}};
  }

  static cudaError_t check(const Params& p) {
    return Kernel::can_implement(arguments(p)) ? cudaSuccess : cudaErrorNotSupported;
  }

  static cudaError_t launch(const Params& p) {
    const auto args = arguments(p);
    if (!Kernel::can_implement(args)) return cudaErrorNotSupported;
    auto params = Kernel::to_underlying_arguments(args, nullptr);
    params.tile_scheduler.longest_first = p.causal;
    return fmha_launch::launch_kernel<Kernel>(params, p.stream);
  }
};

// The instantiations (attention_bwd.h: Variant).

template <DType kType, int kHeadDim>
using VariantKernel = BwdKernel<typename CutlassType<kType>::Type, kHeadDim>;

template <DType kType, int kHeadDim>
cudaError_t Variant<kType, kHeadDim>::check(const Params& p) {
  return VariantKernel<kType, kHeadDim>::check(p);
}

template <DType kType, int kHeadDim>
cudaError_t Variant<kType, kHeadDim>::launch(const Params& p) {
  return VariantKernel<kType, kHeadDim>::launch(p);
}

template <DType kType, int kHeadDim>
cudaError_t Variant<kType, kHeadDim>::load() {
  return fmha_launch::load_kernel<typename VariantKernel<kType, kHeadDim>::Kernel>();
}

}  // namespace pk::attention_bwd
