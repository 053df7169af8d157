// The fused ring attention kernel for one (element type, head dim):
// RingFwdKernel (fwd_kernel.cuh: one producer warpgroup, two math
// warpgroups) around RingMainloop and RingEpilogue.
//
// Launch config: one CTA per (128-row query tile, batch, query head), 384
// threads, heaviest query tiles first (HeavyFirstScheduler); CTAs that start
// late find the peers' blocks already posted. Form kPersistent: one CTA per
// SM over the same order (PersistentHeavyFirstScheduler).
// Arguments: see KernelArgs / Params in ring_attention.h.
// Roles: warp 1 of warpgroup 0 loads Q, K, V (and waits on the posts);
// warpgroups 1 and 2 run QK, softmax and PV on 64 query rows each.
// Mechanism ld_st (AttentionKernel<..., true>): a 1-D grid whose first
// PushArgs::ctas CTAs are communicator CTAs (comm_push.cuh), the compute
// CTAs after them in the same order (CommFirstScheduler).
// Entry point: Variant<type, head dim, mechanism>::launch (ring_attention.h).
#pragma once

#include <type_traits>

#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/numeric_types.h>

#include "kernels/common/cutlass_type.cuh"
#include "kernels/ring_attention/fwd_kernel.cuh"
#include "kernels/ring_attention/ring_epilogue.cuh"

#include "kernels/ring_attention/comm_push.cuh"
#include "kernels/ring_attention/ring_attention.h"
#include "kernels/ring_attention/ring_mainloop.cuh"
#include "kernels/common/fmha_launch.cuh"

namespace pk::ring_attention {

// One CTA per (query tile, batch, head), each head's query tiles launched
// heaviest first: the grid's x walks the query tiles from the last, y the
// batch, z the head. A later query tile sees at least as many keys in both
// layouts (contiguous: more of the ring before it; zigzag: the second chunk
// outweighs the first), so causal launches go longest-first within a head (a
// shorter tail), and the first CTAs have the most work on our own block
// while the peers' blocks are in flight. Heads stay outermost so concurrent
// CTAs share their K/V in L2 (a heads-first order measured 5-10% slower).
struct HeavyFirstScheduler {
  struct Params {
    dim3 grid;
  };
  bool valid = true;

  CUTLASS_DEVICE explicit HeavyFirstScheduler(Params const&) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo,
                                        ClusterShape const&, TileShape const& tile) {
    const int m_blocks = cute::ceil_div(cute::get<2>(problem), cute::get<0>(tile));
    return Params{dim3(m_blocks, cute::get<0>(problem), cute::get<1>(problem))};
  }
  static dim3 get_grid_shape(Params const& p) { return p.grid; }
  CUTLASS_DEVICE bool is_valid() const { return valid; }
  CUTLASS_DEVICE auto get_block_coord() const {
    const int m = int(gridDim.x - 1 - blockIdx.x);
    return cute::make_coord(m, cute::_0{}, cute::make_coord(int(blockIdx.y), int(blockIdx.z)));
  }
  CUTLASS_DEVICE HeavyFirstScheduler& operator++() {
    valid = false;
    return *this;
  }
};

// Persistent CTAs (FwdTile's kPersistentCtas): min(tiles, SMs) CTAs, which
// take HeavyFirstScheduler's order (query tiles from the last, then batch,
// then head) a round of `grid` tiles at a time, so the CTAs at work at any
// time still share their heads' K/V in L2. Rounds alternate direction (CTA c
// takes tile c of even rounds and tile grid - 1 - c of odd ones): under a
// causal mask a CTA given a long tile in one round gets a short one in the
// next, where a fixed stride would hand some CTAs the heavy query tiles of
// every head (its stride a multiple of the tiles per head, nearly).
struct PersistentHeavyFirstScheduler {
  struct Params {
    int m_blocks = 0, batch = 0, tiles = 0, ctas = 0;
  };
  Params const& p;  // the kernel's parameters (not copied into registers)
  int tile;
  bool odd = false;  // in an odd round

  CUTLASS_DEVICE explicit PersistentHeavyFirstScheduler(Params const& params)
      : p(params), tile(int(blockIdx.x)) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const&, TileShape const& shape) {
    const int m_blocks = cute::ceil_div(cute::get<2>(problem), cute::get<0>(shape));
    const int tiles = m_blocks * cute::get<0>(problem) * cute::get<1>(problem);
    const int sms = hw.sm_count > 0 ? hw.sm_count : tiles;
    return Params{m_blocks, cute::get<0>(problem), tiles, tiles < sms ? tiles : sms};
  }
  static dim3 get_grid_shape(Params const& p) { return dim3(unsigned(p.ctas)); }
  CUTLASS_DEVICE bool is_valid() const { return tile < p.tiles; }
  CUTLASS_DEVICE auto get_block_coord() const {
    const int m = p.m_blocks - 1 - tile % p.m_blocks;
    const int i = tile / p.m_blocks;
    return cute::make_coord(m, cute::_0{}, cute::make_coord(i % p.batch, i / p.batch));
  }
  CUTLASS_DEVICE PersistentHeavyFirstScheduler& operator++() {
    // From position c of this round to position grid - 1 - c of the next
    // (even to odd), or back to c (odd to even).
    const int c = int(blockIdx.x);
    tile += odd ? 2 * c + 1 : 2 * (int(gridDim.x) - c) - 1;
    odd = !odd;
    return *this;
  }
};

// Mechanism ld_st: the same order on a 1-D grid, after `comm_ctas`
// communicator CTAs. Linear block i >= comm_ctas is the compute CTA that
// HeavyFirstScheduler's grid has at linear index i - comm_ctas (x fastest,
// then y, then z), so the compute CTAs keep their order.
//
// Why the communicator CTAs come first: the hardware hands out a grid's
// CTAs in increasing linear block index as SMs free up. Blocks 0..C-1 are
// therefore resident before any compute CTA, each on its own SM (the
// kernel's shared memory allows one CTA per SM), and they start pushing at
// once. Placed anywhere else they could wait behind a full wave of compute
// CTAs whose producers spin on posts that the peers' communicator CTAs
// make, and those peers' compute CTAs in turn wait on ours: the first
// wave would stall until the bounded waits gave up. Nothing in CUDA
// promises this order; every GPU we know dispatches so, and the waits stay
// bounded if one did not. The C SMs return to attention once the pushes end.
struct CommFirstScheduler {
  struct Params {
    int m_blocks = 0, batch = 0, heads = 0;
    int comm_ctas = 0;  // set by the ld_st launch (WithCommCtas)
  };
  Params p;
  bool valid = true;

  CUTLASS_DEVICE explicit CommFirstScheduler(Params const& params) : p(params) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem, cutlass::KernelHardwareInfo,
                                        ClusterShape const&, TileShape const& tile) {
    const int m_blocks = cute::ceil_div(cute::get<2>(problem), cute::get<0>(tile));
    return Params{m_blocks, cute::get<0>(problem), cute::get<1>(problem), 0};
  }
  static dim3 get_grid_shape(Params const& p) {
    return dim3(unsigned(p.comm_ctas) + unsigned(p.m_blocks) * p.batch * p.heads);
  }
  CUTLASS_DEVICE bool is_valid() const { return valid; }
  CUTLASS_DEVICE auto get_block_coord() const {
    int i = int(blockIdx.x) - p.comm_ctas;
    const int m = p.m_blocks - 1 - i % p.m_blocks;
    i /= p.m_blocks;
    return cute::make_coord(m, cute::_0{}, cute::make_coord(i % p.batch, i / p.batch));
  }
  CUTLASS_DEVICE CommFirstScheduler& operator++() {
    valid = false;
    return *this;
  }
};

// A CUTLASS kernel (CommFirstScheduler) with PushArgs::ctas communicator
// CTAs in front; cutlass::device_kernel launches it like the kernel itself.
template <class Base>
struct WithCommCtas : Base {
  struct Params {
    typename Base::Params base;
    PushArgs push;
  };
  static dim3 get_grid_shape(Params const& p) { return Base::get_grid_shape(p.base); }
  static Params make_params(typename Base::Params base, PushArgs const& push) {
    base.tile_scheduler.comm_ctas = push.ctas;
    return Params{base, push};
  }
  CUTLASS_DEVICE void operator()(Params const& p, char* smem) {
    if (int(blockIdx.x) < p.push.ctas) {
      push_kv(p.push);
      return;
    }
    Base::operator()(p.base, smem);
  }
};

// (query rows, keys, head dim) of one CTA's tile, the stages of its K/V
// pipeline (K and V tiles share it, one tile a stage) and three mainloop
// variants: the lazy rescale of O (RingMainloop::online_softmax), O's
// rescale under the next QK GEMM and P in two register buffers
// (RingMainloop::compute). Head dims 64 and 128 take the defaults in their
// base forms (head dim 256: FormTile below): 128 keys a tile (64 keys halves
// every QK and PV GEMM and doubles the softmax steps per key;
// benchmarks/NOTES.md, 2026-12-03) in the example's 5 stages; O rescaled
// under the next QK GEMM at head dim 128, between the PV wait and the next
// issue at 64 (each the faster in tools/attention_sweep; NOTES.md,
// 2026-12-05). kDoubleP: P in two register buffers taken in turns, so the
// softmax of one tile runs beside the PV GEMM of the one before (O's rescale
// then follows that GEMM's wait, so kUnderQk does not apply). Head dim 128 at
// 128 keys takes it (tools/attention_sweep: 1.04x without a mask, 0.94-1.07x
// causal, geometric mean 1.02x; NOTES.md, 2026-12-07); head dim 64 does not
// (as fast causal, 3% slower without a mask), nor do wider key tiles (ptxas
// serializes their wgmma or spills). kLazy: head dim 128 under either mask
// (with two P buffers, causal 1.01-1.05x; without a mask 1.005-1.04x in
// tools/attention_sweep, 1.02-1.06x in the op's call; NOTES.md, 2026-12-07).
template <int kHeadDim, int kKeys = 128, int kStages = 5, bool kLazy = (kHeadDim == 128),
          bool kUnderQk = (kHeadDim == 128), bool kDoubleP = (kHeadDim == 128 && kKeys == 128),
          bool kPersistent = false>
struct FwdTile {
  using Shape = cute::Shape<cute::_128, cute::Int<kKeys>, cute::Int<kHeadDim>>;
  using StagesKV = cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kStagesKV,
                                                 cute::Int<kStages>>;
  static constexpr bool kLazyRescale = kLazy;
  static constexpr bool kRescaleUnderQk = kUnderQk;
  static constexpr bool kDoubleBufferP = kDoubleP;
  // CTAs that stay on their SM and take query tile after query tile
  // (PersistentHeavyFirstScheduler): O has its own shared memory, its TMA
  // store left running under the next tile, and the next tile's first K/V
  // load before its Q (RingMainloop::load).
  static constexpr bool kPersistentCtas = kPersistent;
};

// kCommCtas: mechanism ld_st (communicator CTAs in front); false is the
// copy_engine kernel, unchanged.
template <typename Element, int kHeadDim, bool kCommCtas = false, class Tile = FwdTile<kHeadDim>>
struct AttentionKernel {
  // (seq, dim, (batch, head)), 64-bit: the batch strides of q/out (s_local *
  // Hq * D) and of the peers' K/V ((n - 1) * s_local * Hkv * D) pass 2^31
  // elements at sizes a GPU holds (TensorStrides, kv_walk.cuh).
  using Stride = StrideO;
  using TileShape = typename Tile::Shape;
  using Mainloop = RingMainloop<Element, Tile, Stride>;
  static constexpr bool kPersistent = Tile::kPersistentCtas;
  static_assert(!(kPersistent && kCommCtas), "persistent CTAs: mechanism copy_engine only");
  using Epilogue = RingEpilogue<Element, float, typename Mainloop::TileShapePV, kPersistent>;
  using Scheduler = std::conditional_t<
      kCommCtas, CommFirstScheduler,
      std::conditional_t<kPersistent, PersistentHeavyFirstScheduler, HeavyFirstScheduler>>;
  using Fmha = RingFwdKernel<Mainloop, Epilogue, Scheduler>;
  using Kernel = std::conditional_t<kCommCtas, WithCommCtas<Fmha>, Fmha>;
  static_assert(cute::get<0>(TileShape{}) == kTileQ, "host checks assume 128-row query tiles");
  // RingEpilogue writes each warpgroup's O into that warpgroup's Q stage:
  // RingFwdKernel's shared storage overlays epilogue[w] on the mainloop's,
  // whose first member is Q, one stage per math warpgroup.
  // (Persistent CTAs: O has its own shared memory; the next tile's Q loads
  // into the stages.)
  static_assert(kPersistent ||
                    (sizeof(typename Epilogue::TensorStorage) == Mainloop::kOuterLoadBytes &&
                     offsetof(typename Mainloop::SharedStorage, smem_q) == 0),
                "O's shared memory must be the warpgroup's own Q stage");
  // One wgmma spans the key tile: cute offers N outside {8, 16, 32, 64, 96,
  // 128, 192, 256} only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED defined
  // before its headers, and otherwise tiles 176 keys with 16-wide wgmma.
  static_assert(cute::size<1>(typename Mainloop::TiledMmaQK::AtomShape_MNK{}) ==
                    cute::get<1>(TileShape{}),
                "the key tile is not one wgmma wide: define "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED for this key count");

  // [B, rows, heads, D], row-major.
  static Stride stride(int rows, int heads) {
    const TensorStrides s = TensorStrides::of(rows, heads, kHeadDim);
    return Stride{s.row, cute::_1{}, cute::make_tuple(s.batch, s.head)};
  }

  static typename Kernel::Arguments arguments(const KernelArgs& a) {
    const Params& p = *a.p;
    const Geometry& g = p.geo;
    const int peer_rows = g.n > 1 ? (g.n - 1) * g.s_local : g.s_local;
    return typename Kernel::Arguments{
        {p.batch, p.q_heads, g.s_local, g.s_local, kHeadDim},
        {static_cast<const Element*>(p.q), stride(g.s_local, p.q_heads),
         static_cast<const Element*>(p.k), static_cast<const Element*>(p.v),
         stride(g.s_local, p.kv_heads), static_cast<const Element*>(a.k_peers),
         static_cast<const Element*>(a.v_peers), stride(peer_rows, p.kv_heads),
         RingArgs{g, p.q_heads / p.kv_heads, p.kv_heads, p.ch.mine()->posted,
                  &p.ch.mine()->epoch, p.ch.wait, p.scale, p.plan()}},
        {static_cast<Element*>(p.out), stride(g.s_local, p.q_heads), p.lse,
         StrideLse{cute::_1{}, cute::make_tuple(int64_t(p.q_heads) * g.s_local,
                                                int64_t(g.s_local))}},
        cutlass::KernelHardwareInfo{0, p.sm_count}};
  }

  static cudaError_t check(const KernelArgs& a) {
    return Fmha::can_implement(arguments(a)) ? cudaSuccess : cudaErrorNotSupported;
  }

  static cudaError_t launch(const KernelArgs& a) {
    const auto args = arguments(a);
    if (!Fmha::can_implement(args)) return cudaErrorNotSupported;
    auto params = Fmha::to_underlying_arguments(args, nullptr);
    if constexpr (kCommCtas)
      return fmha_launch::launch_kernel<Kernel>(Kernel::make_params(params, a.push),
                                                a.p->stream);
    else
      return fmha_launch::launch_kernel<Kernel>(params, a.p->stream);
  }
};

// The instantiations (ring_attention.h: Variant, Form).

template <int kHeadDim, Form kForm>
struct FormTile {
  static_assert(kForm == Form::kBase, "kWide is head dim 64's, kPersistent head dim 128's");
  using Type = FwdTile<kHeadDim>;
};
// Head dim 128 on a ring of one, up to 2048 tokens (form_of): the base form
// on persistent CTAs (tools/attention_sweep: 1.04x at 16 x 1024 tokens full,
// 1.07x causal at 1024 and 2048; benchmarks/NOTES.md, 2026-12-07).
template <>
struct FormTile<128, Form::kPersistent> {
  using Type = FwdTile<128, 128, 5, true, true, true, /*kPersistent=*/true>;
};
template <>
struct FormTile<64, Form::kWide> {
  using Type = FwdTile<64, 192, 5, /*kLazy=*/false, /*kUnderQk=*/true>;
};
// Head dim 256: 80 keys a tile in 4 stages, O rescaled under QK (1.37x / 1.06x
// cuDNN causal / full at s8192 in tools/attention_sweep, 64 keys 1.19x / 0.96x;
// benchmarks/NOTES.md, 2026-12-05). 80-wide wgmma is among cute's extended
// shapes: its units define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED.
template <>
struct FormTile<256, Form::kBase> {
  using Type = FwdTile<256, 80, 4, /*kLazy=*/false, /*kUnderQk=*/true>;
};

template <DType kType, int kHeadDim, Mechanism kMechanism, Form kForm>
using VariantKernel =
    AttentionKernel<typename CutlassType<kType>::Type, kHeadDim, kMechanism == Mechanism::kLdSt,
                    typename FormTile<kHeadDim, kForm>::Type>;

template <DType kType, int kHeadDim, Mechanism kMechanism, Form kForm>
cudaError_t Variant<kType, kHeadDim, kMechanism, kForm>::check(const KernelArgs& a) {
  return VariantKernel<kType, kHeadDim, kMechanism, kForm>::check(a);
}

template <DType kType, int kHeadDim, Mechanism kMechanism, Form kForm>
cudaError_t Variant<kType, kHeadDim, kMechanism, kForm>::launch(const KernelArgs& a) {
  return VariantKernel<kType, kHeadDim, kMechanism, kForm>::launch(a);
}

template <DType kType, int kHeadDim, Mechanism kMechanism, Form kForm>
cudaError_t Variant<kType, kHeadDim, kMechanism, kForm>::load() {
  return fmha_launch::load_kernel<
      typename VariantKernel<kType, kHeadDim, kMechanism, kForm>::Kernel>();
}

}  // namespace pk::ring_attention
