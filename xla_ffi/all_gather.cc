// FFI handler for pk_jax.all_gather.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/all_gather/all_gather.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

// Values of the "mechanism" attribute (pk_jax/ops/all_gather.py: _MECHANISM_IDS).
enum Mechanism : int32_t { kLdStPull = 0, kCopyEngine = 1, kLdStPush = 2, kLdStLl = 3 };

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Span<const int64_t> group_ids, int64_t group_size,
                         int64_t slot, int64_t data_offset, int64_t rows, int64_t row_bytes,
                         int32_t mechanism, int32_t num_blocks, int64_t timeout_ns,
                         int32_t skip_post_rank) {
  constexpr const char* kOp = "all_gather";
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(kOp, kOpAllGather, ordinal, group_ids,
                                                    group_size, timeout_ns, &ctx);
      e.failure())
    return e;
  const ffi_common::Group& g = ctx.group;
  if (slot < 0 || slot >= kMaxSlots)
    return ffi::Error::InvalidArgument("pk_jax.all_gather: channel slot out of range");
  if (uint64_t(rows) * uint64_t(row_bytes) != x.size_bytes() ||
      out->size_bytes() != x.size_bytes() * size_t(g.n))
    return ffi::Error::InvalidArgument("pk_jax.all_gather: buffer sizes do not match the "
                                       "lowered layout");

  all_gather::Params p;
  p.src = x.untyped_data();
  p.dst = out->untyped_data();
  p.rows = uint64_t(rows);
  p.row_bytes = uint64_t(row_bytes);
  p.rank = g.rank;
  p.n = g.n;
  p.slot = int(slot);
  for (int q = 0; q < g.n; ++q) p.workspace[q] = ctx.workspaces[q];
  p.data_offset = size_t(data_offset);
  p.data_bytes = runtime::Runtime::get().data_bytes();
  p.wait = ctx.wait;
  p.skip_post = skip_post_rank == g.rank;
  // Default grid: one block per SM, measured best for large messages on
  // 2 x H200 (benchmarks/NOTES.md); a caller may ask for up to all co-resident.
  p.max_blocks = num_blocks > 0 ? std::min<int>(num_blocks, g.self->all_gather_max_blocks)
                                : g.self->sm_count;
  p.stream = stream;

  if (x.size_bytes() == 0) return ffi::Error::Success();
  cudaError_t err;
  if (mechanism == kCopyEngine) {
    // The region was sized at lowering (pk_jax/runtime.py: channel).
    if (data_offset < 0 || p.data_offset + all_gather::copy_engine_bytes(p) > p.data_bytes)
      return ffi::Error::InvalidArgument(
          "pk_jax.all_gather: the copy-engine region does not fit the workspace; raise "
          "pk_jax.configure(workspace_bytes=...) or PK_JAX_WORKSPACE_BYTES");
    err = all_gather::launch_copy_engine(p);
  } else if (mechanism == kLdStLl) {
    if (!all_gather::ll_supports(p))
      return ffi::Error::InvalidArgument(
          "pk_jax.all_gather: mechanism 'ld_st_ll' takes up to " +
          std::to_string(kLlMaxBytes) + " bytes per rank in whole 4-byte words, on one of the "
          "first " + std::to_string(kLlChannels) + " channels");
    err = all_gather::launch_ll(p);
  } else if (mechanism == kLdStPull || mechanism == kLdStPush) {
    err = all_gather::launch_ld_st(p, mechanism == kLdStPush);
  } else {
    return ffi::Error::InvalidArgument("pk_jax.all_gather: unknown mechanism id " +
                                       std::to_string(mechanism));
  }
  if (err != cudaSuccess) return ffi_common::cuda_error(kOp, "kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGather, AllGatherImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                          // x: this rank's shard
        .Ret<ffi::AnyBuffer>()                          // gathered result
        .Attr<ffi::Span<const int64_t>>("group_ids")    // device ids, group by group
        .Attr<int64_t>("group_size")                    // ranks per group
        .Attr<int64_t>("slot")                          // workspace channel
        .Attr<int64_t>("data_offset")                   // channel's data region
        .Attr<int64_t>("rows")                          // prod(shape[:axis])
        .Attr<int64_t>("row_bytes")                     // bytes per row and rank
        .Attr<int32_t>("mechanism")                     // Mechanism
        .Attr<int32_t>("num_blocks")                    // ld/st grid cap, 0: one per SM
        .Attr<int64_t>("timeout_ns")                    // bound of every wait
        .Attr<int32_t>("skip_post_rank"),               // testing: -1 normally
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
