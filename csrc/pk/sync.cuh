// Cross-GPU signalling: unicast release stores into a peer's flags, acquire
// loads of our own flags, and spin-waits bounded by %globaltimer.
#pragma once

#include <cstdint>

#include "pk/layout.h"

namespace pk {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Release at system scope: everything this thread wrote (and, through the
// preceding barrier/fence, its block) is visible to a peer that acquires it.
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Acquire and release at system scope in one fence (fence.acq_rel.sys).
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// One CTA's arrival at a counter that `k` CTAs of this GPU add to once per
// call; call from one thread after __syncthreads(). Releases what the CTA
// wrote (system scope: peers read it) and returns true in the CTA whose add
// brings the counter to `target` (the call's k-th add; targets grow with
// the epoch, compared modulo 2^32, so the counter is never reset). That CTA
// has then acquired every arriving CTA's writes: a release store it makes
// next publishes them all.
__device__ __forceinline__ bool arrive_last(uint32_t* counter, uint32_t target) {
  fence_acq_rel_sys();
  const bool last = atomicAdd(counter, 1u) + 1u == target;
  if (last) fence_acq_rel_sys();
  return last;
}

// Atomics on a word that a peer GPU updates too (over NVLink) or that lives
// on a peer: system scope, so both GPUs' atomics on it are ordered.
// Raise *p to at least v; release: what this thread wrote before (and, after
// a fence, its block) is visible to whoever acquires the new value.
__device__ __forceinline__ void max_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Compare-and-swap; returns the old value. Acquire and release.
__device__ __forceinline__ uint64_t cas_acq_rel_sys(uint64_t* p, uint64_t expected,
                                                    uint64_t desired) {
  uint64_t old;
  asm volatile("atom.acq_rel.sys.global.cas.b64 %0, [%1], %2, %3;"
               : "=l"(old)
               : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
}

// Fill the error record once per device (the first error wins): `code` is
// an ErrorCode, the other fields as ErrorRecord describes them for it.
__device__ inline void record_error(const WaitContext& ctx, int32_t code, int32_t peer,
                                    int32_t what, uint64_t expected, uint64_t observed,
                                    uint64_t expected_row_bytes = 0,
                                    uint64_t observed_row_bytes = 0) {
  if (ctx.record == nullptr || atomicCAS(ctx.claim, 0, 1) != 0) return;
  volatile ErrorRecord* r = ctx.record;
  r->op = ctx.op;
  r->rank = ctx.rank;
  r->peer = peer;
  r->what = what;
  r->expected = expected;
  r->observed = observed;
  r->expected_row_bytes = expected_row_bytes;
  r->observed_row_bytes = observed_row_bytes;
  __threadfence_system();
  r->code = code;  // last: the host reads the fields once it sees this
  __threadfence_system();
}

__device__ inline void record_timeout(const WaitContext& ctx, int32_t peer, int32_t what,
                                      uint64_t expected, uint64_t observed) {
  record_error(ctx, kErrTimeout, peer, what, expected, observed);
}

// A zero-copy kernel returns buffers a peer that claimed them may still use
// (pk/offer.h): mark the record, whether or not an error claimed it before
// (one always has: this follows a failed wait), and claim it if not.
__device__ inline void record_unsafe(const WaitContext& ctx, int32_t peer, uint64_t expected,
                                     uint64_t observed) {
  record_timeout(ctx, peer, kWaitClaimedDone, expected, observed);
  if (ctx.record == nullptr) return;
  volatile ErrorRecord* r = ctx.record;
  r->unsafe_peer = peer;
  __threadfence_system();
  r->unsafe = 1;
  __threadfence_system();
}

// True once a wait on this device has given up (the claim word is set until
// check_errors() resets the device): later waits give up at once instead of
// each paying the timeout again (a kernel of many waves would otherwise
// take waves x timeout to finish). Outputs of a call that sees it are
// poisoned (poison_bytes).
__device__ __forceinline__ bool device_failed(const WaitContext& ctx) {
  return ctx.claim != nullptr && *reinterpret_cast<volatile int32_t*>(ctx.claim) != 0;
}
__device__ __forceinline__ bool device_failed(const int32_t* claim) {
  return claim != nullptr && *reinterpret_cast<const volatile int32_t*>(claim) != 0;
}

// Spin on *word until ready(value); false after the timeout or, unless
// kPatient, as soon as another wait on this device has failed, with the
// error recorded (first failure only). The caller then skips the work that
// depended on the word and finishes, so the GPU stays usable. *seen holds
// the last value read. kPatient: the wait for a peer known to be using our
// buffer (pk/offer.h) runs its full timeout whatever failed before.
template <bool kAcquire, typename Ready, bool kPatient = false>
__device__ inline bool spin_bounded(const uint64_t* word, Ready ready, const WaitContext& ctx,
                                    int32_t peer, int32_t what, uint64_t expected,
                                    uint64_t* seen) {
  auto load = [&] { return kAcquire ? load_acquire_sys(word) : load_relaxed_sys(word); };
  uint64_t v = load();
  if (ready(v)) return *seen = v, true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = load();
    if (ready(v)) return *seen = v, true;
    // Read the timer and the claim only every 64 polls: slower than the load.
    if ((spins & 63u) == 0 &&
        (globaltimer_ns() - start > ctx.timeout_ns || (!kPatient && device_failed(ctx))))
      break;
  }
  *seen = v;
  if (!kPatient) record_timeout(ctx, peer, what, expected, v);
  return false;
}

// Ready once a value reaches `target`.
struct AtLeast {
  uint64_t target;
  __device__ __forceinline__ bool operator()(uint64_t v) const { return v >= target; }
};

// Wait until *flag >= target, with acquire ordering.
__device__ inline bool wait_geq(const uint64_t* flag, uint64_t target, const WaitContext& ctx,
                                int32_t peer, int32_t what) {
  uint64_t seen;
  return spin_bounded<true>(flag, AtLeast{target}, ctx, peer, what, target, &seen);
}

// The same without the early give-up and without recording (the caller
// records what a failure means).
__device__ inline bool wait_geq_patient(const uint64_t* flag, uint64_t target,
                                        const WaitContext& ctx, uint64_t* seen) {
  return spin_bounded<true, AtLeast, true>(flag, AtLeast{target}, ctx, -1, 0, target, seen);
}

// Wait until an LL line (data in the low, flag in the high 32 bits) carries
// `flag`; the line is read in one 8-byte load, so its data is current.
__device__ inline bool wait_line(const uint64_t* line, uint32_t flag, const WaitContext& ctx,
                                 int32_t peer, uint64_t* value) {
  return spin_bounded<false>(line, [=](uint64_t v) { return uint32_t(v >> 32) == flag; }, ctx,
                             peer, kWaitLine, flag, value);
}

// Overwrite `bytes` bytes at `p` with `pattern`, shared by threads `tid` of
// `threads`: the poison of a failed call's outputs (16-byte stores where the
// address allows, bytes at the unaligned ends). Only on the failure path.
__device__ inline void poison_bytes(void* p, uint64_t bytes, uint8_t pattern, uint64_t tid,
                                    uint64_t threads) {
  char* c = static_cast<char*>(p);
  const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(c) & 15)) & 15;
  const uint64_t lead = head < bytes ? head : bytes;
  const uint64_t vecs = (bytes - lead) / 16;
  const uint32_t w = 0x01010101u * pattern;
  uint4* v = reinterpret_cast<uint4*>(c + lead);
  for (uint64_t i = tid; i < vecs; i += threads) v[i] = make_uint4(w, w, w, w);
  for (uint64_t i = tid; i < lead; i += threads) c[i] = char(pattern);
  for (uint64_t i = lead + vecs * 16 + tid; i < bytes; i += threads) c[i] = char(pattern);
}

}  // namespace pk
