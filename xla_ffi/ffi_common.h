// Shared pieces of every pk_jax FFI handler: CUDA error conversion, finding
// this device's rank and peers from the static group table, pending errors,
// and the group setup every collective handler starts with (GroupContext).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "pk/channel.h"
#include "pk/layout.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace pk::ffi_common {

namespace ffi = xla::ffi;

inline ffi::Error cuda_error(const char* op, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("pk_jax.") + op + ": " + what + " failed: " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// "pk_jax.<op>: <what>" as an InvalidArgument error.
inline ffi::Error invalid_argument(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("pk_jax.") + op + ": " + what);
}

// A staged op's data region (`needed` bytes) must fit in the `available` bytes
// of the workspace data area after its offset (sized at lowering: runtime.py).
inline ffi::Error check_region_fits(const char* op, size_t needed, size_t available) {
  if (needed <= available) return ffi::Error::Success();
  return invalid_argument(op, "the channel's region does not fit the workspace; raise "
                              "pk_jax.configure(workspace_bytes=...)");
}

// The CUTLASS kernels (GEMMs, attention) were left out of this build.
inline ffi::Error built_without_cutlass(const char* op) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("pk_jax.") + op + ": built without CUTLASS");
}

// This device's view of its communication group.
struct Group {
  int rank = 0;
  int n = 1;
  const runtime::DeviceState* self = nullptr;
  const runtime::DeviceState* members[kMaxRanks] = {};
};

// `group_ids` holds the JAX device ids of every group on the mesh axis, group
// after group, `group_size` each (set at lowering from the concrete mesh).
inline ffi::Error resolve_group(const char* op, ffi::Span<const int64_t> group_ids,
                                int64_t group_size, int32_t ordinal, Group* g) {
  const runtime::Runtime& rt = runtime::Runtime::get();
  g->self = rt.by_ordinal(ordinal);
  if (g->self == nullptr)
    return ffi::Error::Internal(std::string("pk_jax.") + op + ": runtime not initialized for device " +
                                std::to_string(ordinal));
  if (group_size < 1 || group_size > kMaxRanks || group_ids.size() % group_size != 0)
    return ffi::Error::InvalidArgument(std::string("pk_jax.") + op + ": group size " +
                                       std::to_string(group_size) + " unsupported (1.." +
                                       std::to_string(kMaxRanks) + ")");
  for (size_t i = 0; i < group_ids.size(); ++i) {
    if (group_ids[i] != g->self->global_id) continue;
    const size_t first = i - i % group_size;
    g->rank = int(i - first);
    g->n = int(group_size);
    for (int q = 0; q < g->n; ++q) {
      g->members[q] = rt.by_global_id(group_ids[first + q]);
      if (g->members[q] == nullptr)
        return ffi::Error(ffi::ErrorCode::kUnimplemented,
            std::string("pk_jax.") + op + ": device id " + std::to_string(group_ids[first + q]) +
            " is not driven by this process; pk_jax kernels need every GPU of the group "
            "in one process for now");
    }
    return ffi::Error::Success();
  }
  return ffi::Error::Internal(std::string("pk_jax.") + op + ": device " +
                              std::to_string(g->self->global_id) + " is in no group of the mesh axis");
}

// A kernel on this device gave up waiting earlier: refuse to run until the
// user clears the state (the peers' flags are no longer in step).
inline ffi::Error pending_error(const runtime::DeviceState& d) {
  const std::optional<ErrorRecord> r = runtime::recorded_error(d);
  if (!r) return ffi::Error::Success();
  return ffi::Error::Internal(runtime::describe(*r, d.ordinal));
}

inline WaitContext wait_context(const runtime::DeviceState& d, int32_t op, int rank,
                                int64_t timeout_ns) {
  WaitContext w;
  w.record = d.error_device;
  w.claim = &reinterpret_cast<DeviceHeader*>(d.workspace)->error_claim;
  w.timeout_ns = uint64_t(timeout_ns);
  w.op = op;
  w.rank = rank;
  return w;
}

// This device's part in one call of a collective op: its group, every
// member's workspace, and where its failed waits are reported.
struct GroupContext {
  Group group;                       // rank, size, this device and the members
  char* workspaces[kMaxRanks] = {};  // member q's workspace base (peer mapped)
  WaitContext wait{};                // for the op id and timeout given

  // The flags of channel `slot` on every member; check the slot first.
  Channel channel(int slot) const {
    return make_channel(workspaces, group.n, group.rank, slot, wait);
  }
};

// The common start of every handler that talks to its group: finds this
// device's rank and peers in the static group table (resolve_group), refuses
// to run while a kernel on this device has an error recorded (pending_error),
// and fills `ctx` (`op` names the op in messages, `op_id` in error records).
// Still the caller's: checking its slot (0 <= slot < kMaxSlots) and data
// region (data_offset, region size) with its own messages before
// ctx->channel(slot) or using the workspaces; buffers, dtypes and shapes;
// skip_post (skip_post_rank == ctx->group.rank); streams and launch.
inline ffi::Error make_group_context(const char* op, int32_t op_id, int32_t ordinal,
                                     ffi::Span<const int64_t> group_ids, int64_t group_size,
                                     int64_t timeout_ns, GroupContext* ctx) {
  Group& g = ctx->group;
  if (ffi::Error e = resolve_group(op, group_ids, group_size, ordinal, &g); e.failure())
    return e;
  if (ffi::Error e = pending_error(*g.self); e.failure()) return e;
  for (int q = 0; q < g.n; ++q) ctx->workspaces[q] = g.members[q]->workspace;
  ctx->wait = wait_context(*g.self, op_id, g.rank, timeout_ns);
  return ffi::Error::Success();
}

}  // namespace pk::ffi_common
