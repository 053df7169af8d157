// Stream-ordered signalling for mechanisms whose data moves outside a pk
// kernel (copy engines, GEMMs writing to peers): tiny kernels, thread q
// talking to rank q. Each reads the channel's epoch e (calls completed + 1);
// only `finish` advances it, so launch it last.
//
// A failed wait in one of these kernels cannot stop the copies and GEMMs
// enqueued after it on the stream (a copy engine's copy cannot be made
// conditional on a device value, and XLA command buffers allow no graph
// conditionals), so what depends on a wait is made safe where it is read:
//   * a failed credit wait (the peer may still read what we staged with it
//     last call, and our next push overwrites it) marks the peer's channel
//     first (SlotFlags::clobbered) and the push goes ahead; the peer's
//     `finish` of the call that read the slot sees the mark, records
//     kErrClobbered and poisons that call's outputs. The overwritten slot is
//     pk's own staging memory, never an XLA buffer, so the only harm is to
//     the data of that one late call, and it is caught;
//   * a failed wait_posted lets the reads of the unposted slot go ahead; the
//     error is claimed on our device, so our `finish` poisons the outputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pk/channel.h"

namespace pk::signals {

inline constexpr int kAllPeers = -1;

// The layout of a staged block (what a rank puts in a peer's region in one
// call: rows and bytes per row, in the op's terms). The post that makes the
// block ready carries it (the peer's SlotFlags::rows / row_bytes, written
// before the release) and the wait that consumes it compares it with its own:
// a peer whose call staged another layout (two programs sharing the channel
// ran their calls in different orders, or a call under control flow with
// another trip count) records kErrLayout, and `finish` poisons the call's
// outputs. Calls of one layout that pair wrongly are not told apart.
struct PostLayout {
  // Set in `rows` by a block that moves the other way through the same
  // channel (the MoE exchange's combine, against its dispatch).
  static constexpr uint64_t kReturn = uint64_t(1) << 63;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
};

// The outputs of a call: `finish` overwrites every byte of them with
// `pattern` when the call failed (0xFF: a quiet NaN in every IEEE float
// type, -1 in signed and the maximum in unsigned integers; callers pass 0x80
// for the fp8 "fnuz" types, whose only NaN it is).
struct Outputs {
  static constexpr int kMax = 3;  // e.g. dq, dk and dv
  void* ptr[kMax] = {};
  uint64_t bytes[kMax] = {};
  uint8_t pattern = 0xFF;

  Outputs() = default;
  Outputs(void* p, uint64_t n, uint8_t pat = 0xFF) : pattern(pat) { add(p, n); }
  Outputs& add(void* p, uint64_t n) {
    for (int i = 0; i < kMax; ++i)
      if (ptr[i] == nullptr) {
        ptr[i] = p;
        bytes[i] = p != nullptr ? n : 0;
        break;
      }
    return *this;
  }
};

// Wait until every peer's done[q] >= e - 1: each peer has finished reading
// what we staged in its workspace during the previous call (our credit).
// On a timeout, first marks that peer's channel (clobbered[rank] = e; see
// above): the pushes enqueued after this kernel will run regardless.
cudaError_t wait_credit(const Channel& ch, cudaStream_t stream);

// Release posted[rank] = e on `peer` (or every peer), after a system-scope
// fence: what this stream wrote before is visible to a peer that acquires it;
// the staged block's `layout` goes with it. `skip` (testing) launches nothing.
cudaError_t post(const Channel& ch, int peer, const PostLayout& layout, bool skip,
                 cudaStream_t stream);

// `post` to one peer of data this call computed after its own waits (e.g. a
// reduced chunk pushed by the copy engine): when this device holds a claimed
// error, first overwrite `remote` (what the call staged in that peer's
// region) with poison, so the peer reads NaN, never numbers computed from a
// wait that gave up. One block; the poison path is the slow one.
cudaError_t post_checked(const Channel& ch, int peer, const PostLayout& layout,
                         const Outputs& remote, bool skip, cudaStream_t stream);

// Wait until posted[q] >= e for `peer` (or every peer), then check that each
// posted block has `layout` (kErrLayout if not: the call is failed).
cudaError_t wait_posted(const Channel& ch, int peer, const PostLayout& layout,
                        cudaStream_t stream);

// End of a call: release done[rank] = e to every peer (we finished reading
// what they staged with us), check that no peer overwrote our slots while
// we read them (SlotFlags::clobbered > e: kErrClobbered), and when the call
// failed (the device holds a claimed error: one of the call's waits failed,
// or an earlier error is still pending; or `aborted`: the host sequence
// stopped halfway, recorded as kErrAborted) overwrite `outputs` with their
// poison; then advance the epoch. Cost on success: one block, one load of
// the claim word and one of each peer's mark.
cudaError_t finish(const Channel& ch, const Outputs& outputs, cudaStream_t stream,
                   bool aborted = false);

// The end of a call whose host sequence returned `err`: `finish`, as aborted
// when `err` is an error (best effort then: the caller gets `err`).
cudaError_t finish_after(cudaError_t err, const Channel& ch, const Outputs& outputs,
                         cudaStream_t stream);

// Join a forked side stream (after an error too, so no stream dangles):
// `stream` waits for what `side` has enqueued, through `joined`. Returns
// `err`, or the join's own error where `err` is success.
cudaError_t join(cudaError_t err, cudaEvent_t joined, cudaStream_t side, cudaStream_t stream);

// Copy-engine posting, for waits that must not depend on a kernel getting an
// SM: set mine()->stamp[i] = (e - 1) * pieces + i + 1 for i < pieces; a
// stream copy of stamp[i] into a peer's posted[rank] then posts piece i of
// call e (monotonic across calls while `pieces` is fixed per channel).
cudaError_t stamp(const Channel& ch, int pieces, cudaStream_t stream);

// Copy-engine posting of several posts per call to one peer (the stamps of
// `stamp` live in the channel's flags and are at most kMaxStamps; these in
// memory the caller provides, e.g. its staging region): set table[i] =
// (e - 1) * count + i + 1 for i < count. A stream copy of table[i] into a
// peer's posted[rank] posts step i of call e; posts to one peer must be
// issued in increasing i on one stream order, so a post implies the earlier
// ones landed.
cudaError_t stamp_table(const Channel& ch, uint64_t* table, int count, cudaStream_t stream);

// Wait until posted[peer] >= (e - 1) * count + index + 1: `peer` posted step
// `index` (or a later one) of call e with stamp_table's values.
// `mark_clobbered` (the wait is for a credit: `peer` freed a slot that the
// copies after this kernel overwrite): on a timeout, first mark peer's
// channel (clobbered[rank] = e + 1), so its call e poisons its outputs at
// `finish` instead of computing from a slot overwritten under it.
cudaError_t wait_stamp(const Channel& ch, int peer, int index, int count, cudaStream_t stream,
                       bool mark_clobbered = false);

// Load the kernels on the current device (no lazy loading while peers spin).
cudaError_t load_kernels();

}  // namespace pk::signals
