// Symmetric workspace layout shared by host and device code.
//
// Every device of a process owns one workspace of identical layout, and every
// peer maps it (single process: plain device pointers with peer access on).
// Kernels signal by writing into a *peer's* flag slots and wait by polling
// their *own* flags, so every spin-wait is a local load.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pk {

// Largest group a kernel handles. One NVLink domain of one host has at most 8
// GPUs today; 16 leaves room without making the flag area large.
inline constexpr int kMaxRanks = 16;

// Independent (op, device group) channels. Each channel has its own epoch, so
// ops on different groups (the axes of a 2-D mesh) never share counters.
inline constexpr int kMaxSlots = 256;

// Most pieces one staged block is posted in (SlotFlags::stamp).
inline constexpr int kMaxStamps = 8;

// Flags of one channel on one device. Fields indexed by a peer's rank are
// written only by that peer (single writer), the others only locally, except
// `offer`, which the publishing peer and this device both update by atomics
// (pk/offer.h says how).
// All counters are monotonic epochs: no reset kernel is ever needed.
struct alignas(128) SlotFlags {
  uint64_t epoch;                 // calls completed on this device (local)
  uint32_t ticket;                // blocks finished in the running call (local)
  uint32_t pad0;
  // Copy-engine posts: values a stream copy writes into a peer's posted[]
  // (signals::stamp sets them; one per piece of a staged block).
  uint64_t stamp[kMaxStamps];
  uint64_t pad1[14 - kMaxStamps];
  uint64_t ptr[kMaxRanks];        // peer r: address of its buffer (ld/st zero copy)
  uint64_t posted[kMaxRanks];     // peer r: epoch whose staged data is ready
  uint64_t done[kMaxRanks];       // peer r: epoch it finished reading from us
  // Communicator-CTA posts (local): arrivals of the CTAs that pushed piece i
  // of our block to the peer k + 1 ranks ahead (ring attention, ld_st). Each
  // call adds one per CTA, so after call e a counter holds e * CTAs (mod
  // 2^32; the CTA count is fixed per channel): the CTA whose add reaches
  // that value posts the piece.
  uint32_t arrive[kMaxRanks][kMaxStamps];
  // Zero copy (ld/st push and pull): peer r's offer of the buffer at ptr[r]
  // for one call, offer::word(epoch, state). r raises it to "offered" (an
  // atomic max), this device claims it (compare-and-swap) before it touches
  // the buffer, and r revokes it (compare-and-swap) when it gives up, so a
  // late reader either claimed in time (r waits for it) or skips (pk/offer.h).
  uint64_t offer[kMaxRanks];
  // The layout peer r published with its offer (a reader that finds another
  // layout than its own records an error and never copies) or with a staged
  // post (signals::PostLayout: the consumer's wait records the error): two
  // programs that share a channel ran in different orders.
  uint64_t rows[kMaxRanks];
  uint64_t row_bytes[kMaxRanks];
  // Staged mechanisms: the epoch of a call in which peer r pushed into its
  // slot of our region although its credit wait (our done[r] of the call
  // before) had timed out. A call of ours that finishes with an epoch below
  // this value may have read a slot while r overwrote it: its finish records
  // the error and poisons the outputs (signals::finish).
  uint64_t clobbered[kMaxRanks];
};
static_assert(sizeof(SlotFlags) == 1536, "the flag area's size is part of the layout");

// Per-device words that are not tied to a channel.
struct alignas(128) DeviceHeader {
  int32_t error_claim;  // 0 until the first failed wait claims the error record
};

// Low-latency (LL) lines: the first kLlChannels channels can carry messages
// of up to kLlMaxBytes per rank with one-way signalling. A line is 8 bytes,
// 4 of data and 4 of flag (the epoch's low bits), written by one 8-byte store,
// so a reader that sees the flag sees the data. Two parities per channel:
// call e writes parity e & 1, so call e+1 never overwrites lines a slow peer
// still reads. After a sender's kLlMaxBytes / 4 data lines comes its header
// line, {the block's layout, flag}: a receiver whose own layout differs
// records an error instead of reading lines cut for another shape.
inline constexpr int kLlChannels = 32;
inline constexpr size_t kLlMaxBytes = 16 << 10;
inline constexpr size_t kLlHeaderLine = kLlMaxBytes / 4;  // line index of the header
inline constexpr size_t kLlRankBytes = 2 * kLlMaxBytes + 128;  // lines from one sender
inline constexpr size_t kLlChannelBytes = 2 * kMaxRanks * kLlRankBytes;
static_assert((kLlHeaderLine + 1) * 8 <= kLlRankBytes && kLlRankBytes % 128 == 0,
              "a sender's data lines and header line fit its area");

// Workspace = header, channel flags, LL lines, then a data area for staged
// mechanisms. Bytes [0, kDataOffset) hold every flag and line: they are
// zeroed at init and by a reset. The data area is never zeroed: staged data
// is always written before the flag that publishes it.
inline constexpr size_t kSlotsOffset = 4096;
inline constexpr size_t kFlagBytes = kSlotsOffset + sizeof(SlotFlags) * kMaxSlots;
inline constexpr size_t kLlOffset = (kFlagBytes + 4095) / 4096 * 4096;
inline constexpr size_t kDataOffset = kLlOffset + kLlChannels * kLlChannelBytes;
static_assert(sizeof(DeviceHeader) <= kSlotsOffset, "header overlaps the slots");
static_assert(kFlagBytes <= kLlOffset && kLlOffset % 4096 == 0, "LL lines overlap the flags");

// Filled by a kernel that gave up on a call (a bounded wait timed out, or
// a peer's post could not be used); lives in mapped host memory so the host
// can read it while the device is still running. The first error of a
// device claims the record (DeviceHeader::error_claim) and fills the fields
// up to observed_row_bytes; `unsafe` is set apart from it, whenever it
// happens (see below).
struct ErrorRecord {
  int32_t code;        // ErrorCode; 0: none
  int32_t op;          // OpId
  int32_t rank;        // this device's rank in the group
  int32_t peer;        // the peer rank concerned
  int32_t what;        // WaitKind (kErrTimeout; 0 otherwise)
  int32_t pad;
  uint64_t expected;   // per ErrorCode, see there
  uint64_t observed;
  uint64_t expected_row_bytes;  // kErrLayout: our row bytes
  uint64_t observed_row_bytes;  // kErrLayout: the peer's
  // 1 once a zero-copy kernel returned its buffers to XLA while a peer that
  // had claimed them (unsafe_peer, the last such) had still not finished
  // with them after a second full timeout: the peer may still write into
  // (push) or read from (pull) memory XLA reuses. Plain stores (atomics on
  // mapped host memory are not atomic over PCIe): unsafe_peer, a system
  // fence, then unsafe = 1. Read it after synchronizing the device.
  int32_t unsafe;
  int32_t unsafe_peer;
};

enum OpId : int32_t {
  kOpAllGather = 1,
  kOpAllGatherMatmul = 2,
  kOpMatmulReduceScatter = 3,
  kOpRingAttention = 4,
  kOpRingAttentionBwd = 5,
  kOpAllReduce = 6,
  kOpReduceScatter = 7,
  kOpMatmulAllReduce = 8,
  kOpMoe = 9,
  kOpAllGatherMatmulBwd = 10,      // its dx and dw in one call
  kOpMatmulReduceScatterBwd = 11,  // its dx and dw in one call
};
// What a failed wait waited for (ErrorRecord::what, with kErrTimeout).
enum WaitKind : int32_t {
  kWaitPosted = 1,       // the peer's post (staged data, or its zero-copy offer)
  kWaitDone = 2,         // the peer to finish with what we gave it
  kWaitLine = 3,         // the peer's LL lines (data or header)
  kWaitPiece = 4,        // a piece of the peer's K/V block (ring attention)
  kWaitClaimedDone = 5,  // a peer that claimed our buffer to finish with it
  kWaitOffer = 6,        // the peer's zero-copy offer (expected: our epoch;
                         // observed: the offer word, offer::word)
};
// ErrorRecord::code, and what `expected` / `observed` hold.
enum ErrorCode : int32_t {
  kErrNone = 0,
  // A bounded wait timed out (or gave up at once because an earlier wait on
  // this device had): expected = the value waited for (epoch, or stamp /
  // line flag), observed = the last value seen.
  kErrTimeout = 1,
  // Zero copy: the peer gave up on the call and revoked its offer before
  // this rank claimed it (this rank arrived after the peer's timeout), or it
  // already moved on to a later call: expected = our epoch, observed = the
  // offer word (offer::word: epoch * 4 + state).
  kErrRevoked = 2,
  // The peer's block has another layout than ours on a shared channel (two
  // programs ran their gathers in different orders): expected / observed =
  // our / the peer's rows, *_row_bytes our / its row bytes. No byte moved.
  kErrLayout = 3,
  // Staged: a peer pushed into its slot of our region while this call could
  // still read it (the peer's credit wait had timed out): expected = our
  // epoch, observed = the peer's epoch that pushed.
  kErrClobbered = 4,
  // The host sequence failed after enqueuing part of the call (a CUDA error
  // from an enqueue); the call was finished without data: expected =
  // observed = 0.
  kErrAborted = 5,
};
// Where a failed wait is reported. `record` is mapped host memory; `claim`
// is a device word (atomics on mapped host memory are not atomic over PCIe).
struct WaitContext {
  ErrorRecord* record;
  int32_t* claim;
  uint64_t timeout_ns;
  int32_t op;
  int32_t rank;
};

}  // namespace pk
