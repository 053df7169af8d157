// Revocable offers: how a zero-copy kernel (all_gather ld/st push and pull)
// lends an XLA buffer to a peer for one call, so that a timeout is a safe
// abort. Host and device: the decisions below are the kernel's, and
// tests/native/offer_check.cc runs them in every interleaving of a model of
// two ranks (tests/test_offer_protocol_cpu.py).
//
// The problem. Rank r publishes the address of its buffer (its output for
// push, its input for pull) in peer q's channel and waits for q. If q comes
// after r's timeout, r has already returned the buffer to XLA, which reuses
// it; a late q that still trusted the address would write into (push) or
// read from (pull) memory that is no longer r's buffer, and if r has
// meanwhile published a smaller buffer of its next call on the channel, the
// push would run past its end.
//
// The protocol, for call epoch e, one word per (publisher r, reader q) in
// q's channel: SlotFlags::offer[r] = word(epoch, state).
//   publish: r writes ptr[r], rows[r] and row_bytes[r] in q's channel, then
//            raises offer[r] to word(e, kOffered) (release, atomic max: the
//            post is idempotent, every block of r's grid makes it, and it
//            never lowers a claim another block's post raced with).
//   claim:   q waits (bounded) until offer[r] >= word(e, kOffered), then
//            compare-and-swaps word(e, kOffered) -> word(e, kClaimed)
//            (acquire). Claimed (by this or another block of q): q reads
//            ptr/rows/row_bytes; a layout other than its own is an error
//            (kErrLayout) and q copies nothing. Anything else (revoked, or r
//            already at a later call) is an error (kErrRevoked) and q copies
//            nothing. A timed-out wait copies nothing either (kErrTimeout).
//   finish:  q releases done[q] = e in r's channel (whatever it did: it will
//            not touch r's buffer again), then waits (bounded) for done[r] >= e.
//   revoke:  if that wait fails, q compare-and-swaps its own offer in r's
//            channel word(e, kOffered) -> word(e, kRevoked). Swapped: r never
//            claimed it and never will (its claim would now fail). Found
//            word(e, kClaimed): r is using q's buffer, so q waits again, a
//            full timeout that an earlier failure on the device does not cut
//            short, for done[r] >= e; if even that fails, q records that it
//            returns a buffer a peer may still use (ErrorRecord::unsafe).
//            Found an older word: q never offered this call (testing
//            skip_post), nothing to revoke.
// A rank posts call e + 1 only after call e finished, i.e. after every peer
// released done for e or had its offer revoked, so a late reader of call e
// finds word(e, kRevoked) or a word of a later call and never a usable one.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PK_OFFER_HD __host__ __device__ __forceinline__
#else
#define PK_OFFER_HD inline
#endif

namespace pk::offer {

enum State : uint64_t { kNone = 0, kOffered = 1, kClaimed = 2, kRevoked = 3 };

// The offer word of call `epoch` (epochs start at 1; 0 is "never offered").
PK_OFFER_HD uint64_t word(uint64_t epoch, State s) { return epoch * 4 + uint64_t(s); }
PK_OFFER_HD uint64_t epoch_of(uint64_t w) { return w / 4; }
PK_OFFER_HD State state_of(uint64_t w) { return State(w % 4); }

// What a reader of call `epoch` makes of the offer word it saw.
enum class Seen {
  kNotYet,     // the publisher has not offered this call yet: keep waiting
  kClaimable,  // offered and unclaimed: compare-and-swap it to claimed
  kClaimed,    // claimed (by this rank: the reader is its only claimant)
  kGone,       // revoked, or the publisher moved on: never touch the buffer
};
PK_OFFER_HD Seen classify(uint64_t w, uint64_t epoch) {
  if (w < word(epoch, kOffered)) return Seen::kNotYet;
  if (w == word(epoch, kOffered)) return Seen::kClaimable;
  if (w == word(epoch, kClaimed)) return Seen::kClaimed;
  return Seen::kGone;
}

// Ready for a waiting reader: anything but kNotYet ends the wait.
PK_OFFER_HD bool arrived(uint64_t w, uint64_t epoch) { return w >= word(epoch, kOffered); }

// The reader's outcome after its claim: `seen` is the word it waited for,
// `swapped` what its compare-and-swap (made only when `seen` was claimable)
// returned. True: the reader holds the offer and may use the buffer.
PK_OFFER_HD bool claimed(uint64_t seen, uint64_t swapped, uint64_t epoch) {
  const Seen s = classify(seen, epoch);
  if (s == Seen::kClaimed) return true;
  if (s != Seen::kClaimable) return false;
  // The swap returns the old word: claimable (ours now) or already claimed
  // by another block of this rank; revoked or newer: the publisher won.
  const Seen t = classify(swapped, epoch);
  return t == Seen::kClaimable || t == Seen::kClaimed;
}

// The publisher's outcome of revoking call `epoch`'s offer, from the word
// its compare-and-swap word(epoch, kOffered) -> word(epoch, kRevoked)
// returned.
enum class Revoke {
  kRevoked,     // swapped: the peer never claimed and never will
  kInUse,       // the peer claimed it: wait for its done before returning
  kNotOffered,  // this call never offered (testing skip_post): nothing to do
};
PK_OFFER_HD Revoke revoke_outcome(uint64_t old, uint64_t epoch) {
  if (old == word(epoch, kOffered)) return Revoke::kRevoked;
  if (old == word(epoch, kClaimed)) return Revoke::kInUse;
  return Revoke::kNotOffered;
}

// The layout a zero-copy post carries: equal layouts are the reader's only
// guarantee that its copy stays inside the publisher's buffer.
PK_OFFER_HD bool same_layout(uint64_t rows, uint64_t row_bytes, uint64_t peer_rows,
                             uint64_t peer_row_bytes) {
  return rows == peer_rows && row_bytes == peer_row_bytes;
}

// LL header word: an LL block has at most kLlMaxBytes / 4 = 4096 words, so
// rows and words per row both fit 16 bits (all_gather::supported() bounds them).
PK_OFFER_HD uint32_t ll_layout(uint64_t rows, uint64_t row_words) {
  return uint32_t(rows << 16) | uint32_t(row_words & 0xffffu);
}

}  // namespace pk::offer
