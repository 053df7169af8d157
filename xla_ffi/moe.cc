// FFI handler for the MoE token exchange (pk_jax.moe_dispatch / moe_combine,
// mechanism "ld_st"): rows to (rank, row) destinations read on the device.
#include <cuda_runtime.h>

#include <string>

#include "kernels/moe/moe.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "moe";

// Only 0xFF: the exchange carries floating-point rows of the MoE dtypes
// (bf16, f16, f32), where it is a NaN.
constexpr uint8_t kPoison = 0xFF;

bool is_s32(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::S32; }

ffi::Error MoeExchangeImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer src,
                           ffi::AnyBuffer peer, ffi::AnyBuffer index, ffi::AnyBuffer valid,
                           ffi::Result<ffi::AnyBuffer> out, ffi_common::ChannelAttrs channel,
                           int64_t row_bytes) {
  if (row_bytes <= 0 || !is_s32(peer) || !is_s32(index) || !is_s32(valid) ||
      src.size_bytes() % uint64_t(row_bytes) != 0 ||
      out->size_bytes() % uint64_t(row_bytes) != 0)
    return ffi_common::invalid_argument(kOp, "buffers do not match the lowered layout");
  const uint64_t src_rows = src.size_bytes() / uint64_t(row_bytes);
  const uint64_t dst_rows = out->size_bytes() / uint64_t(row_bytes);
  if (peer.element_count() != src_rows || index.element_count() != src_rows ||
      valid.element_count() != dst_rows)
    return ffi_common::invalid_argument(kOp, "routing arrays do not match the row counts");
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(
          kOp, kOpMoe, ordinal, channel, moe::staging_bytes(dst_rows, uint64_t(row_bytes)), &ctx);
      e.failure())
    return e;

  moe::Params p;
  p.src = src.untyped_data();
  p.peer = static_cast<const int32_t*>(peer.untyped_data());
  p.index = static_cast<const int32_t*>(index.untyped_data());
  p.valid = static_cast<const int32_t*>(valid.untyped_data());
  p.dst = out->untyped_data();
  p.src_rows = src_rows;
  p.dst_rows = dst_rows;
  p.row_bytes = uint64_t(row_bytes);
  p.ch = ctx.channel;
  for (int q = 0; q < ctx.group.n; ++q) p.region[q] = ctx.regions[q];
  p.skip_post = ctx.skip_post;
  p.poison = kPoison;
  p.stream = stream;
  if (cudaError_t err = moe::launch_exchange(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "exchange launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeExchange, MoeExchangeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                       // src: [src_rows, H] rows to send
        .Arg<ffi::AnyBuffer>()                       // peer: [src_rows] int32 destination rank
        .Arg<ffi::AnyBuffer>()                       // index: [src_rows] int32 row there
        .Arg<ffi::AnyBuffer>()                       // valid: [dst_rows] int32, >= 0: a row lands
        .Ret<ffi::AnyBuffer>()                       // [dst_rows, H]
        .Attr<ffi_common::ChannelAttrs>("channel")   // group, slot, region, timeout
        .Attr<int64_t>("row_bytes"),                 // bytes per row
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
