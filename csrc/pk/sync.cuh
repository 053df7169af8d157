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


// Spin until *flag >= target (acquire). Returns false after the timeout and
// fills the error record (first failure wins); the caller then skips the work
// that depended on the flag and finishes, so the GPU stays usable.
__device__ inline bool wait_geq(const uint64_t* flag, uint64_t target,
                                const WaitContext& ctx, int32_t peer,
                                int32_t what) {
  uint64_t v = load_acquire_sys(flag);
  if (v >= target) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    v = load_acquire_sys(flag);
    if (v >= target) return true;
    // Read the timer only every 64 polls: it is slower than the load.
    if ((++spins & 63u) == 0 && globaltimer_ns() - start > ctx.timeout_ns) break;
  }
  if (ctx.record != nullptr && atomicCAS(ctx.claim, 0, 1) == 0) {
    volatile ErrorRecord* r = ctx.record;
    r->op = ctx.op;
    r->rank = ctx.rank;
    r->peer = peer;
    r->what = what;
    r->expected = target;
    r->observed = v;
    __threadfence_system();
    r->code = kErrTimeout;  // last: the host reads the fields once it sees this
    __threadfence_system();
  }
  return false;
}

}  // namespace pk
