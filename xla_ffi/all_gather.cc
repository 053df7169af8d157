// FFI handler for pk_jax.all_gather.
#include <cuda_runtime.h>

#include <string>

#include "kernels/all_gather/all_gather.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "all_gather";

// The byte a failed call's output is filled with (all_gather.h: poison):
// all bits set, a quiet NaN in every IEEE float type (bf16, f16, f32, f64,
// complex; e4m3fn, e4m3, e5m2, e3m4 and e8m0fnu too) and -1 / the maximum in
// integers; 0x80 for the fp8 types without infinities whose only NaN it is.
uint8_t poison_byte(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FNUZ:
    case ffi::DataType::F8E5M2FNUZ:
    case ffi::DataType::F8E4M3B11FNUZ:
      return 0x80;
    default:
      return 0xFF;
  }
}

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, ffi_common::ChannelAttrs channel,
                         int64_t rows, int64_t row_bytes, int32_t mechanism,
                         int32_t num_blocks) {
  if (!all_gather::is_mechanism(mechanism))
    return ffi_common::invalid_argument(kOp, "unknown mechanism id " + std::to_string(mechanism));
  const auto m = static_cast<all_gather::Mechanism>(mechanism);
  // Only the copy engine stages data: n blocks of x (group_size is checked first).
  const size_t needed = m == all_gather::Mechanism::kCopyEngine
                            ? all_gather::copy_engine_bytes(int(channel.group_size), x.size_bytes())
                            : 0;
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(kOp, kOpAllGather, ordinal, channel, needed,
                                                    &ctx);
      e.failure())
    return e;
  const ffi_common::Group& g = ctx.group;
  if (m == all_gather::Mechanism::kLdStPull || m == all_gather::Mechanism::kLdStPush)
    if (ffi::Error e = ffi_common::require_one_process(
            kOp, g, m == all_gather::Mechanism::kLdStPush ? "ld_st_push" : "ld_st_pull");
        e.failure())
      return e;
  uint64_t block = 0;  // rows * row_bytes, overflow-checked
  if (rows < 0 || row_bytes < 0 ||
      __builtin_mul_overflow(uint64_t(rows), uint64_t(row_bytes), &block) ||
      block != x.size_bytes() || out->size_bytes() != x.size_bytes() * size_t(g.n))
    return ffi_common::invalid_argument(kOp, "buffer sizes do not match the lowered layout");

  all_gather::Params p;
  p.mechanism = m;
  p.src = x.untyped_data();
  p.dst = out->untyped_data();
  p.rows = uint64_t(rows);
  p.row_bytes = uint64_t(row_bytes);
  p.ch = ctx.channel;
  p.slot = ctx.slot;
  for (int q = 0; q < g.n; ++q) {
    p.workspace[q] = ctx.workspaces[q];
    p.region[q] = ctx.regions[q];
  }
  p.skip_post = ctx.skip_post;
  p.poison = poison_byte(x.element_type());
  p.device = ordinal;
  p.num_blocks = num_blocks;
  p.stream = stream;

  if (x.size_bytes() == 0) return ffi::Error::Success();
  if (!all_gather::supported(p))  // only ld_st_ll has bounds
    return ffi_common::invalid_argument(
        kOp, "mechanism 'ld_st_ll' takes up to " + std::to_string(kLlMaxBytes) +
                 " bytes per rank in whole 4-byte words, on one of the first " +
                 std::to_string(kLlChannels) + " channels");
  if (cudaError_t err = all_gather::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGather, AllGatherImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                       // x: this rank's shard
        .Ret<ffi::AnyBuffer>()                       // gathered result
        .Attr<ffi_common::ChannelAttrs>("channel")   // group, slot, region, timeout
        .Attr<int64_t>("rows")                       // prod(shape[:axis])
        .Attr<int64_t>("row_bytes")                  // bytes per row and rank
        .Attr<int32_t>("mechanism")                  // all_gather::Mechanism
        .Attr<int32_t>("num_blocks"),                // ld/st grid cap, 0: one per SM
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
