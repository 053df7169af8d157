// A rank's view of one workspace channel on every rank of its group.
#pragma once

#include "pk/layout.h"

namespace pk {

struct Channel {
  SlotFlags* flags[kMaxRanks];  // the channel's flags on every rank (peer mapped)
  WaitContext wait;             // where a failed wait is reported
  int rank;
  int n;

#ifdef __CUDACC__
  __host__ __device__
#endif
  SlotFlags* mine() const { return flags[rank]; }

#ifdef __CUDACC__
  // Epoch of the call in flight: calls completed on this device + 1. Read it
  // before any block finishes (the last block of a launch advances it).
  __device__ uint64_t next_epoch() const {
    return *reinterpret_cast<volatile uint64_t*>(&flags[rank]->epoch) + 1;
  }
#endif
};

// `workspaces[q]` is rank q's workspace base; `slot` the channel index.
inline Channel make_channel(char* const* workspaces, int n, int rank, int slot,
                            const WaitContext& wait) {
  Channel c{};
  for (int q = 0; q < n; ++q)
    c.flags[q] = reinterpret_cast<SlotFlags*>(workspaces[q] + kSlotsOffset) + slot;
  c.wait = wait;
  c.rank = rank;
  c.n = n;
  return c;
}

}  // namespace pk
