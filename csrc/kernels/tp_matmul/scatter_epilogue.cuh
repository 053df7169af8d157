// The fused matmul_reduce_scatter's epilogue: plugged into CUTLASS's
// warp-specialized cooperative GEMM (through its adapter for epilogues
// without a TMA pipeline), it runs in the two consumer warpgroups after each
// output tile's mainloop and decides where the tile goes. Each tile passes
// through shared memory in two halves of 128 columns (rounded to the output
// type; padded rows, conflict-free for the fragment writes and row reads).
//
// Tile of rank q's rows, q != r (a partial for q): each of 128 threads hands
// one staged row to the bulk-copy engine (cp.async.bulk, shared -> global,
// straight into slot r of q's region over NVLink), so the consumers go on to
// the next tile's mainloop while the bytes travel. The tile's flag on q,
// flags[r][tile] = epoch, is released at the start of this CTA's next tile
// (or at the end, store_tail) after the copies have completed: a fence per
// tile would stall the consumers for an NVLink round trip.
// Tile of our own rows: one thread waits (bounded) for every sender's flag of
// this tile; the staged tile is summed in fp32 with each sender's slot and
// written to our shard as 16-byte vectors, rounded once more (as the chunked
// path's sum pass).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
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
  static constexpr int kStride = kPassCols + kVec;       // padded row: 272 bytes
  static constexpr int kVectorsPerThread = kM * kChunks / kThreads;
  static constexpr int kBatch = 2;  // own-row vectors whose partials load together
  static_assert(sizeof(Out) == 2, "the fused path writes 16-bit outputs");
  static_assert(kN % kPassCols == 0 && (kM * kChunks) % kThreads == 0 && kM <= kThreads);
  static_assert(kVectorsPerThread % kBatch == 0);
  static_assert(kM == kFusedTileM && kN == kFusedTileN, "tp_matmul.h sizes the flags by this tile");

  // ---- arguments ---------------------------------------------------------------
  // What CUTLASS's kernel and adapter read from an epilogue collective.
  using ElementC = Out;
  using ElementD = Out;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ThreadEpilogueOp = void;
  // One pass: kM rows x kPassCols columns, each row padded by 16 bytes (68
  // words: the 8 rows x 4 lanes of a fragment write hit 32 banks) and
  // contiguous (one bulk copy per row). 34 KiB: the mainloop keeps 4 stages.
  struct SharedStorage {
    alignas(128) Out tile[kM * kStride];
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
    thread_ = thread_idx;
    release_pending();
    const int64_t row0 = int64_t(get<0>(blk_coord)) * kM;  // in x's n*m rows
    if (row0 >= t.n * t.m) return;  // a row the cluster shape pads on
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

    CUTLASS_PRAGMA_NO_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      // The staging is free once the copy engine has read the last pass's
      // rows (this CTA's previous tile, or this tile's first half).
      if (thread_idx < kM) bulk_wait_read();
      sync_consumers();
      // Fragment -> shared memory, this pass's columns, rounded to Out.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const int r = get<0>(coord(i));
        const int c = get<1>(coord(i)) - pass * kPassCols;
        if (c >= 0 && c < kPassCols) staged[r * kStride + c] = Out(acc(i));
      }
      cutlass::arch::fence_view_async_shared();  // the copy engine reads what we wrote
      sync_consumers();
      const int64_t col = col0 + pass * kPassCols;
      if (col >= t.n_cols) continue;
      if (!own) {
        // One row per thread, the columns that exist (N is a multiple of 8).
        const int bytes = int(min<int64_t>(kPassCols, t.n_cols - col)) * int(sizeof(Out));
        if (thread_idx < kM) {
          Out* dst = reinterpret_cast<Out*>(t.remote[owner]) +
                     (shard_row0 + thread_idx) * t.n_cols + col;
          bulk_copy_to_global(dst, staged + thread_idx * kStride, bytes);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kVectorsPerThread; k += kBatch) add_batch(staged, t, shard_row0, col, k);
      }
    }
    if (!own && !t.skip_post) {
      pending_flag_ = t.flags_remote[owner] + t.rank * t.tiles + tile;
      pending_epoch_ = epoch;
    }
  }

  // After this CTA's last tile (the kernel's consumers call it once).
  CUTLASS_DEVICE void release_pending() {
    if (pending_flag_ == nullptr) return;
    if (thread_ < kM) bulk_wait_complete();  // the row copies have landed on the peer
    sync_consumers();
    if (thread_ == 0) {
      fence_acq_rel_sys();
      store_release_sys(pending_flag_, pending_epoch_);
    }
    pending_flag_ = nullptr;
  }

 private:
  Params const& params_;
  // This thread's copy of the collective (every consumer thread has one, all
  // keep the same state): the flag of the last peer tile, released later.
  uint64_t* pending_flag_ = nullptr;
  uint64_t pending_epoch_ = 0;
  int thread_ = 0;

  CUTLASS_DEVICE static void bulk_copy_to_global(Out* dst, const Out* src, int bytes) {
    const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;" ::"l"(dst), "r"(s), "r"(bytes) : "memory");
  }
  // This thread's bulk copies have read their shared memory source.
  CUTLASS_DEVICE static void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
  // This thread's bulk copies have written their destination; the proxy fence
  // orders those (async proxy) writes before the flag's generic release.
  CUTLASS_DEVICE static void bulk_wait_complete() {
    asm volatile("cp.async.bulk.wait_group 0;\nfence.proxy.async.global;" ::: "memory");
  }

  CUTLASS_DEVICE static void sync_consumers() {
    // The consumer threads' epilogue barrier: this epilogue replaces the one
    // CUTLASS reserves it for.
    cutlass::arch::NamedBarrier::sync(kThreads,
                                      cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
  }

  // Vectors k .. k+kBatch-1 of this thread in a pass of our rows: the staged
  // tile plus every sender's partial, summed in fp32, to our shard. Each
  // sender's kBatch loads are issued together, before any store (a store to
  // the output could alias a later load as far as the compiler knows, which
  // would serialize one memory round trip per vector). The slots were written
  // by peers: read them through L2 (ld.global.cg).
  CUTLASS_DEVICE void add_batch(const Out* staged, const ScatterTarget& t, int64_t shard_row0,
                                int64_t col, int k) const {
    float sum[kBatch][kVec];
    int64_t at[kBatch];
    bool in[kBatch];
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int v = (k + b) * kThreads + thread_;
      const int r = v / kChunks, c = (v % kChunks) * kVec;
      in[b] = col + c < t.n_cols;
      at[b] = (shard_row0 + r) * t.n_cols + col + c;
      const uint4 ours = *reinterpret_cast<const uint4*>(staged + r * kStride + c);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kVec; ++j) sum[b][j] = float(reinterpret_cast<const Out*>(&ours)[j]);
    }
    const size_t slot_elems = size_t(t.m) * t.n_cols;
    for (int s = 0; s < t.n; ++s) {
      if (s == t.rank) continue;
      const Out* slot = reinterpret_cast<const Out*>(t.slots) + s * slot_elems;
      uint4 raw[kBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBatch; ++b)
        raw[b] = in[b] ? __ldcg(reinterpret_cast<const uint4*>(slot + at[b])) : uint4{};
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBatch; ++b)
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kVec; ++j) sum[b][j] += float(reinterpret_cast<const Out*>(&raw[b])[j]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      if (!in[b]) continue;
      uint4 out;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kVec; ++j) reinterpret_cast<Out*>(&out)[j] = Out(sum[b][j]);
      *reinterpret_cast<uint4*>(static_cast<Out*>(t.out) + at[b]) = out;
    }
  }

};

// The collective the kernel sees: CUTLASS's adapter around ScatterEpilogue,
// with a store_tail that releases the flag of the CTA's last peer tile.
template <typename Out, typename TileShape>
class ScatterCollective : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
                              ScatterEpilogue<Out, TileShape>> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      ScatterEpilogue<Out, TileShape>>;

 public:
  using Base::Base;

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline load_pipeline, LoadState load_state,
                                 StorePipeline store_pipeline, StoreState store_state) {
    this->release_pending();
    return Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
  }
};

}  // namespace pk::tp_matmul
