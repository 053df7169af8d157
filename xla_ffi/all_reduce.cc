// FFI handler for pk_jax.all_reduce and pk_jax.reduce_scatter (one target,
// the "kind" attribute tells them apart).
#include <cuda_runtime.h>

#include <string>

#include "kernels/all_reduce/all_reduce.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

bool elem_of(ffi::DataType t, all_reduce::Elem* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = all_reduce::Elem::kBF16; return true;
    case ffi::DataType::F16: *out = all_reduce::Elem::kF16; return true;
    case ffi::DataType::F32: *out = all_reduce::Elem::kF32; return true;
    case ffi::DataType::S32: *out = all_reduce::Elem::kS32; return true;
    default: return false;
  }
}

bool mul_ok(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, ffi_common::ChannelAttrs channel,
                         ffi_common::ChannelAttrs channel2, int32_t kind, int32_t mechanism,
                         int64_t rows, int64_t stride, int64_t chunk) {
  const bool scatter = kind == int32_t(all_reduce::Kind::kReduceScatter);
  const char* op = scatter ? "reduce_scatter" : "all_reduce";
  const int32_t op_id = scatter ? kOpReduceScatter : kOpAllReduce;
  // Everything is validated before the first enqueue.
  if (!all_reduce::is_kind(kind))
    return ffi_common::invalid_argument(op, "unknown kind " + std::to_string(kind));
  if (!all_reduce::is_mechanism(mechanism))
    return ffi_common::invalid_argument(op, "unknown mechanism id " + std::to_string(mechanism));
  all_reduce::Elem elem;
  if (!elem_of(x.element_type(), &elem) || out->element_type() != x.element_type())
    return ffi_common::invalid_argument(op, "takes bf16, f16, f32 or s32 with a result of the "
                                            "input's type");
  const int64_t n = channel.group_size;
  if (n < 1 || n > kMaxRanks || rows < 0 || stride < 0 || chunk < 0)
    return ffi_common::invalid_argument(op, "invalid layout attributes");
  all_reduce::Geometry geo;
  geo.rows = uint64_t(rows);
  geo.stride = uint64_t(stride);
  geo.chunk = uint64_t(chunk);
  geo.n = int(n);
  const uint64_t es = all_reduce::elem_bytes(elem);
  uint64_t in_elems = 0, in_bytes = 0, cover = 0, slot = 0, slot_bytes = 0, n_slots = 0,
           all_in_bytes = 0;
  if (!mul_ok(geo.rows, geo.stride, &in_elems) || !mul_ok(in_elems, es, &in_bytes) ||
      !mul_ok(geo.chunk, uint64_t(n), &cover) || !mul_ok(geo.rows, geo.chunk, &slot) ||
      !mul_ok(slot, es, &slot_bytes) || !mul_ok(slot_bytes, uint64_t(n), &n_slots) ||
      !mul_ok(in_bytes, uint64_t(n), &all_in_bytes))
    return ffi_common::invalid_argument(op, "sizes overflow 64 bits");
  const uint64_t out_bytes = scatter ? slot_bytes : in_bytes;
  if (in_bytes != x.size_bytes() || out_bytes != out->size_bytes() || cover < geo.stride ||
      (scatter && cover != geo.stride) || (!scatter && geo.rows > 1))
    return ffi_common::invalid_argument(op, "buffer sizes do not match the lowered layout");

  const auto m = static_cast<all_reduce::Mechanism>(mechanism);
  const auto k = static_cast<all_reduce::Kind>(kind);
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(
          op, op_id, ordinal, channel, all_reduce::phase1_bytes(m, k, geo, elem), &ctx);
      e.failure())
    return e;
  all_reduce::Params p;
  p.mechanism = m;
  const size_t second = all_reduce::phase2_bytes(m, k, geo, elem);
  if (second > 0 || (!scatter && m != all_reduce::Mechanism::kOneShot)) {
    if (channel2.group_size != n || channel2.slot == channel.slot)
      return ffi_common::invalid_argument(op, "the second channel does not match the first");
    ffi_common::GroupContext ctx2;
    if (ffi::Error e = ffi_common::make_group_context(op, op_id, ordinal, channel2, second, &ctx2);
        e.failure())
      return e;
    p.ch2 = ctx2.channel;
    for (int q = 0; q < ctx2.group.n; ++q) p.region2[q] = ctx2.regions[q];
  }
  const ffi_common::Group& g = ctx.group;
  p.src = x.untyped_data();
  p.dst = out->untyped_data();
  p.elem = elem;
  p.kind = k;
  p.geo = geo;
  p.ch = ctx.channel;
  for (int q = 0; q < g.n; ++q) p.region[q] = ctx.regions[q];
  p.skip_post = ctx.skip_post;
  p.poison = 0xFF;  // a quiet NaN in bf16, f16 and f32; -1 in int32
  p.sm_count = g.self->sm_count;
  p.stream = stream;

  if (x.size_bytes() == 0) return ffi::Error::Success();
  if (cudaError_t err = all_reduce::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(op, "enqueue", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllReduce, AllReduceImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                       // x: this rank's operand
        .Ret<ffi::AnyBuffer>()                       // the sum (all_reduce) or our chunk of it
        .Attr<ffi_common::ChannelAttrs>("channel")   // phase 1: group, slot, region, timeout
        .Attr<ffi_common::ChannelAttrs>("channel2")  // phase 2 (two-shot all_reduce)
        .Attr<int32_t>("kind")                       // all_reduce::Kind
        .Attr<int32_t>("mechanism")                  // all_reduce::Mechanism
        .Attr<int64_t>("rows")                       // all_reduce.h: Geometry
        .Attr<int64_t>("stride")
        .Attr<int64_t>("chunk"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
