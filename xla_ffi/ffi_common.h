// Shared pieces of every pk_jax FFI handler: CUDA error conversion, finding
// this device's rank and peers from the static group table, pending errors,
// and the channel setup every collective handler starts with (the `channel`
// attribute, ChannelAttrs, checked into a GroupContext).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>

#include "kernels/common/dtype.h"
#include "kernels/gemm/gemm.h"
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

// The FP8 GEMMs' attributes, as gemm::Problem holds them.
struct Fp8Gemm {
  gemm::Scaling scaling = gemm::Scaling::kTensor;
  gemm::Library library = gemm::Library::kCutlass;
  bool fast_accum = false;
};

// The FP8 GEMMs' attributes `scaling` (gemm.h: Scaling, kTensor or kBlock),
// `library` (gemm.h: Library) and `fast_accum` (gemm::Problem::fast_accum),
// checked.
inline ffi::Error read_fp8_gemm(const char* op, int32_t scaling, int32_t library,
                                bool fast_accum, Fp8Gemm* out) {
  if (scaling != int32_t(gemm::Scaling::kTensor) && scaling != int32_t(gemm::Scaling::kBlock))
    return invalid_argument(op, "scaling is 1 (tensor) or 2 (block), got " +
                                    std::to_string(scaling));
  if (library != int32_t(gemm::Library::kCutlass) && library != int32_t(gemm::Library::kCublasLt))
    return invalid_argument(op, "library is 0 (CUTLASS) or 1 (cuBLASLt), got " +
                                    std::to_string(library));
  if (fast_accum && scaling != int32_t(gemm::Scaling::kTensor))
    return invalid_argument(op, "fast_accum is for per-tensor factors (scaling 1)");
  *out = Fp8Gemm{gemm::Scaling(scaling), gemm::Library(library), fast_accum};
  return ffi::Error::Success();
}

// The CUTLASS kernels (GEMMs, attention) were left out of this build.
inline ffi::Error built_without_cutlass(const char* op) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("pk_jax.") + op + ": built without CUTLASS");
}

// The kernels' element type of an XLA type (false for one no kernel takes).
inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F8E4M3FN: *out = DType::kE4M3; return true;
    case ffi::DataType::F8E5M2: *out = DType::kE5M2; return true;
    default: return false;
  }
}

// Whether a buffer's dimensions are exactly `want` (another buffer's, or a
// list such as {rows, n}).
inline bool same_dims(ffi::Span<const int64_t> d, ffi::Span<const int64_t> want) {
  if (d.size() != want.size()) return false;
  for (size_t i = 0; i < d.size(); ++i)
    if (d[i] != want[i]) return false;
  return true;
}
inline bool same_dims(ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  return same_dims(d, ffi::Span<const int64_t>(want.begin(), want.size()));
}

// This device's view of its communication group.
struct Group {
  int rank = 0;
  int n = 1;
  const runtime::DeviceState* self = nullptr;  // this (local) device
  int64_t ids[kMaxRanks] = {};                 // member q's JAX device id
  char* workspaces[kMaxRanks] = {};            // member q's workspace base, as self reaches it
  // Some member is driven by another process: only workspace memory is
  // shared with it. An address of one of that member's own buffers (XLA's
  // inputs and outputs) means nothing here, so zero-copy mechanisms that
  // publish buffer addresses (all_gather ld_st push/pull) cannot run.
  bool spans_processes = false;
};

// `group_ids` holds the JAX device ids of every group on the mesh axis, group
// after group, `group_size` each (set at lowering from the concrete mesh).
// Only `self` must be driven by this process; the other members may be GPUs
// of other processes of this host whose workspaces were imported, and every
// member must have been connected to self (runtime: connect_group, at
// lowering).
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
    for (int q = 0; q < g->n; ++q) g->ids[q] = group_ids[first + q];
    int bad = 0;
    switch (rt.member_workspaces(*g->self, g->ids, g->n, g->workspaces, &bad,
                                 &g->spans_processes)) {
      case runtime::MemberStatus::kOk:
        return ffi::Error::Success();
      case runtime::MemberStatus::kUnknown:
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
            std::string("pk_jax.") + op + ": device id " + std::to_string(g->ids[bad]) +
            " is not known to this process: it is driven by another process that did not "
            "share its workspace (pk_jax shares workspaces between processes of one host at "
            "the first lowering) or lives on another host (pk_jax groups must stay inside "
            "one host)");
      case runtime::MemberStatus::kNotConnected:
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
            std::string("pk_jax.") + op + ": device id " + std::to_string(g->ids[bad]) +
            " was never connected to device id " + std::to_string(g->self->global_id) +
            " (pk_jax connects the devices of every group when it lowers an op for it: was "
            "this program lowered by another process or another pk_jax version?)");
    }
  }
  return ffi::Error::Internal(std::string("pk_jax.") + op + ": device " +
                              std::to_string(g->self->global_id) + " is in no group of the mesh axis");
}

// For mechanisms that read or write the members' own buffers (not their
// workspaces) through published addresses: those addresses are valid only in
// the process that drives the member.
inline ffi::Error require_one_process(const char* op, const Group& g, const char* mechanism) {
  if (!g.spans_processes) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("pk_jax.") + op + ": mechanism '" + mechanism + "' shares buffer "
                    "addresses between the ranks, which works only when one process drives "
                    "every GPU of the group; this group spans processes (use a mechanism that "
                    "stages through the workspace)");
}

// A kernel on this device gave up waiting earlier: refuse to run until the
// user clears the state (the peers' flags are no longer in step).
inline ffi::Error pending_error(const runtime::DeviceState& d) {
  const std::optional<ErrorRecord> r = runtime::recorded_error(d);
  if (!r) return ffi::Error::Success();
  return ffi::Error::Internal(runtime::describe(*r, d.ordinal));
}

// The streams of a host sequence that forks a side stream (the Params of
// tp_matmul, ring_attention, ring_attention_bwd): XLA's `stream`, and this
// device's side stream with its fork and join events; and, where the Params
// have one (ring_attention), the copy stream beside the side stream.
template <class Params, class = void>
struct HasCopyStream : std::false_type {};
template <class Params>
struct HasCopyStream<Params, std::void_t<decltype(Params::copy_stream)>> : std::true_type {};

template <class Params>
void set_streams(Params* p, cudaStream_t stream, const runtime::DeviceState& d) {
  p->stream = stream;
  p->side_stream = d.side_stream;
  p->fork = d.fork;
  p->join = d.join;
  if constexpr (HasCopyStream<Params>::value) {
    p->copy_stream = d.copy_stream;
    p->copy_done = d.copy_done;
  }
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

// The `channel` attribute every collective handler takes (a dictionary,
// pk_jax/ops/_lowering.py: channel_attr), set at lowering.
struct ChannelAttrs {
  ffi::Span<const int64_t> group_ids;  // device ids of every group of the axis, group after group
  int64_t group_size;                  // ranks per group
  int64_t slot;                        // channel index in the workspace flags
  int64_t data_offset;                 // the channel's region in the data area
  int64_t data_bytes;                  // bytes reserved for it (0: stages nothing)
  int64_t timeout_ns;                  // bound of every wait
  int32_t skip_post_rank;              // testing: this rank never posts; -1 normally
};

// This device's part in one call of a collective op.
struct GroupContext {
  Group group;                       // rank, size, this device and the members
  char* workspaces[kMaxRanks] = {};  // member q's workspace base (as Group::workspaces)
  char* regions[kMaxRanks] = {};     // member q's channel region (data area + data_offset)
  Channel channel{};                 // the channel's flags on every member, wait context
  int slot = 0;
  bool skip_post = false;            // this rank is skip_post_rank
};

// The common start of every collective handler: finds this device's rank and
// peers in the group table, refuses to run while a kernel on this device has
// an error recorded, checks the slot and the channel's region (inside the
// workspace data area, and `needed` bytes of this call within the
// `data_bytes` reserved at lowering), and fills `ctx`. `op` names the op in
// messages, `op_id` in error records. `needed` may be computed from
// c.group_size before this call: it is looked at only once the group is valid.
inline ffi::Error make_group_context(const char* op, int32_t op_id, int32_t ordinal,
                                     const ChannelAttrs& c, size_t needed, GroupContext* ctx) {
  Group& g = ctx->group;
  if (ffi::Error e = resolve_group(op, c.group_ids, c.group_size, ordinal, &g); e.failure())
    return e;
  if (ffi::Error e = pending_error(*g.self); e.failure()) return e;
  if (c.slot < 0 || c.slot >= kMaxSlots)
    return invalid_argument(op, "channel slot " + std::to_string(c.slot) + " is outside [0, " +
                                    std::to_string(kMaxSlots) + "): the pk_jax package and its "
                                    "native extension do not match; reinstall pk_jax");
  if (c.timeout_ns <= 0)
    return invalid_argument(op, "timeout_ns must be positive, got " + std::to_string(c.timeout_ns));
  const uint64_t area = runtime::Runtime::get().data_bytes();
  if (c.data_offset < 0 || c.data_bytes < 0 || uint64_t(c.data_offset) > area ||
      uint64_t(c.data_bytes) > area - uint64_t(c.data_offset))
    return invalid_argument(
        op, "the channel's region (" + std::to_string(c.data_bytes) + " bytes at offset " +
                std::to_string(c.data_offset) + ") does not fit the workspace data area of " +
                std::to_string(area) + " bytes; raise pk_jax.configure(workspace_bytes=...) or "
                "PK_JAX_WORKSPACE_BYTES before the first pk_jax op");
  if (needed > uint64_t(c.data_bytes))
    return invalid_argument(
        op, "this call stages " + std::to_string(needed) + " bytes but its channel region has " +
                std::to_string(c.data_bytes) + ": the lowering sized it for other shapes (the "
                "pk_jax package and its native extension do not match; reinstall pk_jax)");
  for (int q = 0; q < g.n; ++q) {
    ctx->workspaces[q] = g.workspaces[q];
    ctx->regions[q] = ctx->workspaces[q] + kDataOffset + c.data_offset;
  }
  ctx->slot = int(c.slot);
  ctx->channel = make_channel(ctx->workspaces, g.n, g.rank, ctx->slot,
                              wait_context(*g.self, op_id, g.rank, c.timeout_ns));
  ctx->skip_post = c.skip_post_rank == g.rank;
  return ffi::Error::Success();
}

}  // namespace pk::ffi_common

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(pk::ffi_common::ChannelAttrs,
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("group_ids"),
                                      ::xla::ffi::StructMember<int64_t>("group_size"),
                                      ::xla::ffi::StructMember<int64_t>("slot"),
                                      ::xla::ffi::StructMember<int64_t>("data_offset"),
                                      ::xla::ffi::StructMember<int64_t>("data_bytes"),
                                      ::xla::ffi::StructMember<int64_t>("timeout_ns"),
                                      ::xla::ffi::StructMember<int32_t>("skip_post_rank"));
