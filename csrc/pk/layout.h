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
// written only by that peer (single writer), the others only locally.
// All counters are monotonic epochs: no reset kernel is ever needed.
struct alignas(128) SlotFlags {
  uint64_t epoch;                 // calls completed on this device (local)
  uint32_t ticket;                // blocks finished in the running call (local)
  uint32_t pad0;
  // Copy-engine posts: values a stream copy writes into a peer's posted[]
  // (signals::stamp sets them; one per piece of a staged block).
  uint64_t stamp[kMaxStamps];
  uint64_t pad1[14 - kMaxStamps];
  uint64_t ptr[kMaxRanks];        // peer r: address of its source buffer
  uint64_t posted[kMaxRanks];     // peer r: epoch whose data/pointer is ready
  uint64_t done[kMaxRanks];       // peer r: epoch it finished reading from us
  // Communicator-CTA posts (local): arrivals of the CTAs that pushed piece i
  // of our block to the peer k + 1 ranks ahead (ring attention, ld_st). Each
  // call adds one per CTA, so after call e a counter holds e * CTAs (mod
  // 2^32; the CTA count is fixed per channel): the CTA whose add reaches
  // that value posts the piece.
  uint32_t arrive[kMaxRanks][kMaxStamps];
};
static_assert(sizeof(SlotFlags) == 1024, "the flag area's size is part of the layout");

// Per-device words that are not tied to a channel.
struct alignas(128) DeviceHeader {
  int32_t error_claim;  // 0 until the first failed wait claims the error record
};

// Low-latency (LL) lines: the first kLlChannels channels can carry messages
// of up to kLlMaxBytes per rank with one-way signalling. A line is 8 bytes,
// 4 of data and 4 of flag (the epoch's low bits), written by one 8-byte store,
// so a reader that sees the flag sees the data. Two parities per channel:
// call e writes parity e & 1, so call e+1 never overwrites lines a slow peer
// still reads.
inline constexpr int kLlChannels = 32;
inline constexpr size_t kLlMaxBytes = 16 << 10;
inline constexpr size_t kLlRankBytes = 2 * kLlMaxBytes;  // lines from one sender
inline constexpr size_t kLlChannelBytes = 2 * kMaxRanks * kLlRankBytes;

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

// Filled by a kernel whose bounded wait gave up; lives in mapped host memory
// so the host can read it while the device is still running.
struct ErrorRecord {
  int32_t code;        // 0: none, 1: timeout
  int32_t op;          // OpId
  int32_t rank;        // this device's rank in the group
  int32_t peer;        // rank waited for
  int32_t what;        // WaitKind
  int32_t pad;
  uint64_t expected;   // epoch waited for
  uint64_t observed;   // last value seen
};

enum OpId : int32_t {
  kOpAllGather = 1,
  kOpAllGatherMatmul = 2,
  kOpMatmulReduceScatter = 3,
  kOpRingAttention = 4,
};
enum WaitKind : int32_t {
  kWaitPosted = 1,
  kWaitDone = 2,
  kWaitLine = 3,
  kWaitPiece = 4,
};
enum ErrorCode : int32_t { kErrNone = 0, kErrTimeout = 1 };

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
