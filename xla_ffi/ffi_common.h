// Shared pieces of every pk_jax FFI handler: CUDA error conversion, finding
// this device's rank and peers from the static group table, pending errors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "pk/layout.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace pk::ffi_common {

namespace ffi = xla::ffi;

inline ffi::Error cuda_error(const char* op, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("pk_jax.") + op + ": " + what + " failed: " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
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
  const volatile ErrorRecord* r = d.error_host;
  if (r->code == kErrNone) return ffi::Error::Success();
  ErrorRecord copy;
  copy.code = r->code; copy.op = r->op; copy.rank = r->rank; copy.peer = r->peer;
  copy.what = r->what; copy.expected = r->expected; copy.observed = r->observed;
  return ffi::Error::Internal(runtime::describe(copy, d.ordinal));
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

}  // namespace pk::ffi_common
