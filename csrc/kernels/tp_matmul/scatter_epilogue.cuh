// The fused matmul_reduce_scatter's epilogue: plugged into CUTLASS's
// warp-specialized cooperative GEMM (through its adapter for epilogues
// without a TMA pipeline), it runs in the two consumer warpgroups after each
// output tile's mainloop and decides where the tile goes.
//
// Tile of rank q's rows, q != r (a partial for q): rounded to the output
// type, staged in shared memory and written as 16-byte row vectors into slot
// r of q's region (stores over NVLink), then, once every thread's stores are
// fenced, flags[r][tile] = epoch is released on q.
// Tile of our own rows: one thread waits (bounded) for every sender's flag of
// this tile; the tile, rounded, is summed in fp32 with each sender's slot and
// written to our shard, rounded once more (as the chunked path's sum pass).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cstdint>

#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/sync.cuh"

namespace pk::tp_matmul {

template <typename Out, typename TileShape>
class ScatterEpilogue {
 public:
  // ---- launch config ---------------------------------------------------------
  static constexpr int kM = cute::size<0>(TileShape{});
  static constexpr int kN = cute::size<1>(TileShape{});
  static constexpr int kThreads = 256;                   // two consumer warpgroups
  static constexpr int kVec = 16 / int(sizeof(Out));     // elements per 16-byte vector
  static constexpr int kPassCols = 128;                  // columns staged per pass
  static constexpr int kPasses = kN / kPassCols;
  static constexpr int kChunks = kPassCols / kVec;       // 16-byte chunks per staged row
  static constexpr int kVectorsPerThread = kM * kChunks / kThreads;
  static_assert(sizeof(Out) == 2, "the fused path writes 16-bit outputs");
  static_assert(kN % kPassCols == 0 && (kM * kChunks) % kThreads == 0);
  static_assert(kM == kFusedTileM && kN == kFusedTileN, "tp_matmul.h sizes the flags by this tile");

  // ---- arguments ---------------------------------------------------------------
  // What CUTLASS's kernel and adapter read from an epilogue collective.
  using ElementC = Out;
  using ElementD = Out;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ThreadEpilogueOp = void;
  // One pass: kM rows x kPassCols columns, 16-byte chunks XOR-swizzled by row
  // so the fragment writes (8 rows x 4 lanes per instruction) and the row
  // vector reads are both free of bank conflicts. 32 KiB: the mainloop keeps
  // its 4 stages.
  struct SharedStorage {
    alignas(128) Out tile[kM * kPassCols];
  };
  using TensorStorage = SharedStorage;
  struct Arguments {
    ScatterTarget target;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  // Rows: n shards of m, each a whole number of tiles; N in 16-byte vectors.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    const ScatterTarget& t = a.target;
    return t.n > 1 && t.m % kM == 0 && int64_t(cute::get<0>(shape)) == t.n * t.m &&
           int64_t(cute::get<1>(shape)) == t.n_cols && t.n_cols % kVec == 0;
  }

  CUTLASS_HOST_DEVICE explicit ScatterEpilogue(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // ---- roles: one output tile -------------------------------------------------
  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    const ScatterTarget& t = params_.target;
    const int64_t row0 = int64_t(get<0>(blk_coord)) * kM;  // in x's n*m rows
    const int owner = int(row0 / t.m);
    const int64_t shard_row0 = row0 - owner * t.m;
    const int64_t col0 = int64_t(get<1>(blk_coord)) * kN;
    const int64_t tile = shard_row0 / kM * t.tiles_n + get<1>(blk_coord);
    const bool own = owner == t.rank;
    const uint64_t epoch = t.ch.next_epoch();
    Out* staged = reinterpret_cast<Out*>(smem);

    // Our rows: the senders' partials of this tile must have landed. One
    // thread acquires every flag; the barrier after staging orders the other
    // threads' loads after it. A wait that times out has recorded the error;
    // the tile is still written (the call's output is then undefined).
    if (own && thread_idx == 0)
      for (int s = 0; s < t.n; ++s)
        if (s != t.rank) wait_geq(t.flags_local + s * t.tiles + tile, epoch, t.ch.wait, s, kWaitTile);

    auto thr = tiled_mma.get_thread_slice(thread_idx);
    Tensor coord = thr.partition_C(make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{})));
    Out* dst = own ? static_cast<Out*>(t.out) : reinterpret_cast<Out*>(t.remote[owner]);

    CUTLASS_PRAGMA_NO_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      // Fragment -> shared memory, this pass's columns, rounded to Out.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const int r = get<0>(coord(i));
        const int c = get<1>(coord(i)) - pass * kPassCols;
        if (c >= 0 && c < kPassCols) staged[swizzled(r, c)] = Out(acc(i));
      }
      sync_consumers();
      // Shared memory -> global, 16-byte vectors along rows.
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kVectorsPerThread; ++k) {
        const int v = k * kThreads + thread_idx;
        const int r = v / kChunks;
        const int c = (v % kChunks) * kVec;
        const int64_t col = col0 + pass * kPassCols + c;
        if (col >= t.n_cols) continue;
        uint4 val = *reinterpret_cast<const uint4*>(staged + swizzled(r, c));
        const int64_t at = (shard_row0 + r) * t.n_cols + col;
        if (own) val = add_partials(val, t, at);
        *reinterpret_cast<uint4*>(dst + at) = val;
      }
      sync_consumers();  // the next pass (or tile) overwrites the staging
    }

    // A peer's tile: every thread's stores precede the barrier above; one
    // thread's system-scope fence then makes them visible before the flag.
    if (!own && thread_idx == 0 && !t.skip_post) {
      fence_acq_rel_sys();
      store_release_sys(t.flags_remote[owner] + t.rank * t.tiles + tile, epoch);
    }
  }

 private:
  Params const& params_;

  CUTLASS_DEVICE static int swizzled(int r, int c) {
    return r * kPassCols + (((c / kVec) ^ (r & 7)) * kVec) + c % kVec;
  }

  CUTLASS_DEVICE static void sync_consumers() {
    // The consumer threads' epilogue barrier: this epilogue replaces the one
    // CUTLASS reserves it for.
    cutlass::arch::NamedBarrier::sync(kThreads,
                                      cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
  }

  // ours + every sender's partial at element offset `at`, summed in fp32. The
  // slots were written by peers: read them through L2 (ld.global.cg).
  CUTLASS_DEVICE static uint4 add_partials(uint4 ours, const ScatterTarget& t, int64_t at) {
    const Out* mine = reinterpret_cast<const Out*>(&ours);
    float sum[kVec];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kVec; ++j) sum[j] = float(mine[j]);
    const size_t slot_elems = size_t(t.m) * t.n_cols;
    for (int s = 0; s < t.n; ++s) {
      if (s == t.rank) continue;
      const uint4 raw =
          __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const Out*>(t.slots) +
                                                s * slot_elems + at));
      const Out* theirs = reinterpret_cast<const Out*>(&raw);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kVec; ++j) sum[j] += float(theirs[j]);
    }
    uint4 out;
    Out* o = reinterpret_cast<Out*>(&out);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kVec; ++j) o[j] = Out(sum[j]);
    return out;
  }
};

}  // namespace pk::tp_matmul
