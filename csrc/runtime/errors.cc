// Runtime: the error records kernels write (pending_errors, recorded_error)
// and their text (describe).
#include "pk/signals.h"
#include "runtime/workspace.h"

#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace pk::runtime {

std::vector<PendingError> Runtime::pending_errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PendingError> out;
  for (const DeviceState& d : devices_) {
    if (d.ordinal < 0 || d.error_host == nullptr) continue;
    if (std::optional<ErrorRecord> r = recorded_error(d)) out.push_back({d.ordinal, *r});
  }
  return out;
}

std::optional<ErrorRecord> recorded_error(const DeviceState& d) {
  // Field by field through volatile: a kernel may be writing the record.
  const volatile ErrorRecord* r = d.error_host;
  if (r->code == kErrNone) return std::nullopt;
  ErrorRecord copy;
  copy.code = r->code; copy.op = r->op; copy.rank = r->rank; copy.peer = r->peer;
  copy.what = r->what; copy.pad = 0; copy.expected = r->expected; copy.observed = r->observed;
  copy.expected_row_bytes = r->expected_row_bytes;
  copy.observed_row_bytes = r->observed_row_bytes;
  copy.unsafe = r->unsafe;
  copy.unsafe_peer = r->unsafe_peer;
  return copy;
}

namespace {

// What a timed-out wait waited for (WaitKind).
std::string waited_for(const ErrorRecord& r) {
  const std::string e = std::to_string(r.expected);
  switch (r.what) {
    case kWaitPosted: return "post for epoch " + e;
    case kWaitLine: return "send its data lines for epoch " + e;
    case kWaitPiece: return "post a piece of its K/V block, stamp " + e;
    case kWaitClaimedDone: return "finish with the buffer it claimed";
    case kWaitOffer:
      return "offer its buffer for epoch " + e + "; saw offer word " +
             std::to_string(r.observed) + " (epoch " + std::to_string(r.observed / 4) +
             ", state " + std::to_string(r.observed % 4) + ")";
    default: return "finish its transfer for epoch " + e;
  }
}

// A staged block's layout (signals::PostLayout): rows x row bytes, and the
// direction when the block moves the return way (the MoE combine).
std::string layout_text(uint64_t rows, uint64_t row_bytes) {
  const bool back = rows & signals::PostLayout::kReturn;
  return std::to_string(rows & ~signals::PostLayout::kReturn) + "x" + std::to_string(row_bytes) +
         (back ? " returning" : "");
}

}  // namespace

std::string describe(const ErrorRecord& r, int ordinal) {
  static const char* kOps[] = {"?", "all_gather", "all_gather_matmul",
                               "matmul_reduce_scatter", "ring_attention",
                               "ring_attention_bwd", "all_reduce", "reduce_scatter",
                               "matmul_all_reduce", "moe", "all_gather_matmul (backward)",
                               "matmul_reduce_scatter (backward)"};
  const char* op = (r.op > 0 && r.op < int(std::size(kOps))) ? kOps[r.op] : "?";
  const std::string where = std::string("pk_jax.") + op + " on device " +
                            std::to_string(ordinal) + " (rank " + std::to_string(r.rank) + "): ";
  const std::string peer = "peer rank " + std::to_string(r.peer);
  std::string text;
  switch (r.code) {
    case kErrRevoked:
      text = where + peer + " had revoked its offer for epoch " + std::to_string(r.expected) +
             " (it gave up waiting; this rank arrived after the timeout); nothing was copied";
      break;
    case kErrLayout:
      text = where + peer + "'s block layout (" + layout_text(r.observed, r.observed_row_bytes) +
             ") differs from this rank's (" + layout_text(r.expected, r.expected_row_bytes) +
             ") on a shared channel: two programs ran their collectives in different orders; "
             "the call's outputs are poisoned";
      break;
    case kErrClobbered:
      text = where + peer + " overwrote this rank's staging slot (its epoch " +
             std::to_string(r.observed) + ") before this rank's call " +
             std::to_string(r.expected) + " finished reading it (the peer's wait for its credit "
             "gave up: it timed out, or an earlier failure on the peer's device ended it; "
             "after mispaired calls, two programs ran their collectives in different orders)";
      break;
    case kErrAborted:
      text = where + "the call was aborted after part of it was enqueued";
      break;
    default:
      text = where + "timed out waiting for " + peer + " to " + waited_for(r) +
             (r.what == kWaitOffer ? "" : " but saw " + std::to_string(r.observed)) +
             ". The peer is missing, hung, or ran a different program";
  }
  text += ". The outputs of that call and of later pk_jax calls on this device are poisoned "
          "(NaN; integer gathers: all bits set) until pk_jax.check_errors() clears this state.";
  if (r.unsafe)
    text += " UNSAFE: returned buffers to XLA while peer rank " + std::to_string(r.unsafe_peer) +
            " still held them after a second timeout; memory may be corrupt, restart the "
            "process.";
  return text;
}

}  // namespace pk::runtime
