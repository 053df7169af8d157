// FFI handlers of the MoE token exchange (pk_jax.moe_dispatch / moe_combine):
// mechanism "ld_st", slots to rows (dispatch) or rows to slots (combine); on an
// expert axis of one device, each token's rows written (dispatch) and each
// token's rows summed (combine), and the layout of those rows computed from
// the expert ids. The routing is read on the device (kernels/moe/moe.h).
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
  if (cudaError_t err = moe::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "exchange launch", err);
  return ffi::Error::Success();
}

// The element type of the one-device kernels' rows (both buffers), or false.
bool row_type(const ffi::AnyBuffer& src, const ffi::AnyBuffer& out, DType* t) {
  return src.element_type() == out.element_type() && src.dimensions().size() == 2 &&
         out.dimensions().size() == 2 && src.dimensions()[1] == out.dimensions()[1] &&
         ffi_common::to_dtype(src.element_type(), t) && !is_fp8(*t);
}

// A float32 per-slot vector: `count` entries when `present`, else ignored.
bool slot_floats(const ffi::AnyBuffer& b, uint64_t count, bool present) {
  return !present || (b.element_type() == ffi::DataType::F32 && b.element_count() == count);
}

ffi::Error MoeScatterRowsImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::AnyBuffer dest,
                              ffi::AnyBuffer row_slot, ffi::AnyBuffer scale,
                              ffi::Result<ffi::AnyBuffer> out, int64_t repeat, int32_t scaled) {
  moe::ScatterParams p;
  if (!row_type(src, *out, &p.type) || !is_s32(dest) || !is_s32(row_slot) || repeat <= 0 ||
      row_slot.element_count() != out->dimensions()[0] ||
      dest.element_count() != uint64_t(src.dimensions()[0]) * uint64_t(repeat))
    return ffi_common::invalid_argument(
        kOp, "scatter_rows takes src [S, H] and out [R, H] of one type (bf16, f16 or f32), "
             "int32 dest [S * repeat] and int32 row_slot [R]");
  p.src_rows = uint64_t(src.dimensions()[0]);
  p.repeat = uint64_t(repeat);
  if (!slot_floats(scale, p.src_rows * p.repeat, scaled != 0))
    return ffi_common::invalid_argument(kOp, "scatter_rows' scale must be float32 [S * repeat]");
  p.src = src.untyped_data();
  p.out = out->untyped_data();
  p.dest = static_cast<const int32_t*>(dest.untyped_data());
  p.row_slot = static_cast<const int32_t*>(row_slot.untyped_data());
  p.scale = scaled != 0 ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  p.rows = uint64_t(out->dimensions()[0]);
  p.cols = uint64_t(out->dimensions()[1]);
  p.stream = stream;
  if (cudaError_t err = moe::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "scatter_rows launch", err);
  return ffi::Error::Success();
}

ffi::Error MoeWeightedSumImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::AnyBuffer index,
                              ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> out,
                              int32_t weighted) {
  moe::SumParams p;
  const bool rows_ok = row_type(src, *out, &p.type);
  const uint64_t tokens = rows_ok ? uint64_t(out->dimensions()[0]) : 0;
  const uint64_t slots = index.element_count();
  if (!rows_ok || !is_s32(index) || (tokens == 0 ? slots != 0 : slots % tokens != 0))
    return ffi_common::invalid_argument(
        kOp, "weighted_sum takes src [R, H] and out [T, H] of one type (bf16, f16 or f32) and "
             "an int32 index [T * k]");
  if (!slot_floats(weight, slots, weighted != 0))
    return ffi_common::invalid_argument(kOp, "weighted_sum's weight must be float32 [T * k]");
  p.src = src.untyped_data();
  p.out = out->untyped_data();
  p.index = static_cast<const int32_t*>(index.untyped_data());
  p.weight = weighted != 0 ? static_cast<const float*>(weight.untyped_data()) : nullptr;
  p.src_rows = uint64_t(src.dimensions()[0]);
  p.tokens = tokens;
  p.k = tokens == 0 ? 1 : slots / tokens;
  p.cols = uint64_t(out->dimensions()[1]);
  p.stream = stream;
  if (cudaError_t err = moe::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "weighted_sum launch", err);
  return ffi::Error::Success();
}

bool is_scalar_s32(const ffi::AnyBuffer& b) { return is_s32(b) && b.element_count() == 1; }

ffi::Error MoeLayoutImpl(cudaStream_t stream, ffi::AnyBuffer expert_ids,
                         ffi::Result<ffi::AnyBuffer> dest_row, ffi::Result<ffi::AnyBuffer> src_slot,
                         ffi::Result<ffi::AnyBuffer> group_sizes,
                         ffi::Result<ffi::AnyBuffer> num_dropped,
                         ffi::Result<ffi::AnyBuffer> num_invalid, int64_t capacity) {
  const bool ids64 = expert_ids.element_type() == ffi::DataType::S64;
  if ((!ids64 && !is_s32(expert_ids)) || !is_s32(*dest_row) || !is_s32(*src_slot) ||
      !is_s32(*group_sizes) || !is_scalar_s32(*num_dropped) || !is_scalar_s32(*num_invalid) ||
      dest_row->element_count() != expert_ids.element_count())
    return ffi_common::invalid_argument(
        kOp, "layout takes int32 or int64 expert_ids [S] and returns int32 dest_row [S], "
             "src_slot [R], group_sizes [E] and two int32 scalars");
  moe::LayoutParams p;
  p.slots = expert_ids.element_count();
  p.rows = src_slot->element_count();
  const uint64_t experts = group_sizes->element_count();
  if (p.slots > moe::kLayoutMaxSlots || p.rows > moe::kLayoutMaxRows || experts < 1 ||
      experts > uint64_t(moe::kLayoutMaxExperts))
    return ffi_common::invalid_argument(
        kOp, "layout's kernel takes at most " + std::to_string(moe::kLayoutMaxSlots) +
                 " slots, " + std::to_string(moe::kLayoutMaxRows) + " rows and 1 to " +
                 std::to_string(moe::kLayoutMaxExperts) + " experts (beyond: the XLA layout)");
  p.expert_ids = expert_ids.untyped_data();
  p.ids64 = ids64;
  p.dest_row = static_cast<int32_t*>(dest_row->untyped_data());
  p.src_slot = static_cast<int32_t*>(src_slot->untyped_data());
  p.group_sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  p.num_dropped = static_cast<int32_t*>(num_dropped->untyped_data());
  p.num_invalid = static_cast<int32_t*>(num_invalid->untyped_data());
  p.experts = int32_t(experts);
  p.capacity = capacity;
  p.stream = stream;
  if (cudaError_t err = moe::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "layout launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeLayout, MoeLayoutImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()                       // expert_ids: [S] int32 or int64
        .Ret<ffi::AnyBuffer>()                       // dest_row: [S] int32 row of each slot, -1
        .Ret<ffi::AnyBuffer>()                       // src_slot: [R] int32 slot of each row, -1
        .Ret<ffi::AnyBuffer>()                       // group_sizes: [E] int32 rows of each expert
        .Ret<ffi::AnyBuffer>()                       // num_dropped: [] int32
        .Ret<ffi::AnyBuffer>()                       // num_invalid: [] int32
        .Attr<int64_t>("capacity"),                  // rows each expert keeps, -1: all
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeScatterRows, MoeScatterRowsImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()                       // src: [S, H] (tokens: S = slots / repeat)
        .Arg<ffi::AnyBuffer>()                       // dest: [slots] int32 row of each slot, < 0
        .Arg<ffi::AnyBuffer>()                       // row_slot: [R] int32 slot of each row, < 0
        .Arg<ffi::AnyBuffer>()                       // scale: [slots] float32 (or [0])
        .Ret<ffi::AnyBuffer>()                       // [R, H]
        .Attr<int64_t>("repeat")                     // slots per src row
        .Attr<int32_t>("scaled"),                    // 1: rows times their slot's scale
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeWeightedSum, MoeWeightedSumImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()                       // src: [R, H]
        .Arg<ffi::AnyBuffer>()                       // index: [T * k] int32 row of each slot
        .Arg<ffi::AnyBuffer>()                       // weight: [T * k] float32 (or [0])
        .Ret<ffi::AnyBuffer>()                       // [T, H]
        .Attr<int32_t>("weighted"),                  // 1: each row times its slot's weight
    {ffi::Traits::kCmdBufferCompatible});

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
