// FFI handler for the MoE token exchange (pk_jax.moe_dispatch / moe_combine,
// mechanism "ld_st"): slots to rows (dispatch) or rows to slots (combine),
// the routing read on the device (kernels/moe/moe.h).
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
                           ffi::AnyBuffer slot_peer, ffi::AnyBuffer slot_row,
                           ffi::AnyBuffer row_src, ffi::Result<ffi::AnyBuffer> out,
                           ffi_common::ChannelAttrs channel, int64_t row_bytes, int32_t to_slots,
                           int64_t repeat) {
  if (row_bytes <= 0 || repeat <= 0 || (to_slots != 0 && repeat != 1) || !is_s32(slot_peer) ||
      !is_s32(slot_row) || !is_s32(row_src) || src.size_bytes() % uint64_t(row_bytes) != 0 ||
      out->size_bytes() % uint64_t(row_bytes) != 0)
    return ffi_common::invalid_argument(kOp, "buffers do not match the lowered layout");
  const uint64_t slots = slot_peer.element_count();
  const uint64_t rows = row_src.element_count();
  const uint64_t src_rows = src.size_bytes() / uint64_t(row_bytes);
  const uint64_t out_rows = out->size_bytes() / uint64_t(row_bytes);
  const bool ok = slot_row.element_count() == slots &&
                  (to_slots != 0 ? src_rows == rows && out_rows == slots
                                 : src_rows * uint64_t(repeat) == slots && out_rows == rows);
  if (!ok) return ffi_common::invalid_argument(kOp, "routing arrays do not match the row counts");
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(
          kOp, kOpMoe, ordinal, channel, moe::staging_bytes(rows, uint64_t(row_bytes)), &ctx);
      e.failure())
    return e;

  moe::Params p;
  p.dir = to_slots != 0 ? moe::Direction::kToSlots : moe::Direction::kToRows;
  p.src = src.untyped_data();
  p.dst = out->untyped_data();
  p.slot_peer = static_cast<const int32_t*>(slot_peer.untyped_data());
  p.slot_row = static_cast<const int32_t*>(slot_row.untyped_data());
  p.row_src = static_cast<const int32_t*>(row_src.untyped_data());
  p.slots = slots;
  p.rows = rows;
  p.repeat = uint64_t(repeat);
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
        .Arg<ffi::AnyBuffer>()                       // src: [slots / repeat] or [rows], H
        .Arg<ffi::AnyBuffer>()                       // slot_peer: [slots] int32 rank of its row
        .Arg<ffi::AnyBuffer>()                       // slot_row: [slots] int32 its row there
        .Arg<ffi::AnyBuffer>()                       // row_src: [rows] int32 source rank, -1
        .Ret<ffi::AnyBuffer>()                       // [rows] or [slots], H
        .Attr<ffi_common::ChannelAttrs>("channel")   // group, slot, region, timeout
        .Attr<int64_t>("row_bytes")                  // bytes per row
        .Attr<int32_t>("to_slots")                   // 0: slots -> rows, 1: rows -> slots
        .Attr<int64_t>("repeat"),                    // slots per src row (to rows)
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
