// FFI handler for pk_jax.ring_attention (the fused kernel, mechanisms
// "copy_engine" and "ld_st"): q, k, v of this rank -> out and the log-sum-exp.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/ring_attention/ring_attention.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "ring_attention";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error RingAttentionImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                             ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi_common::ChannelAttrs channel, float scale, bool causal,
                             bool zigzag, int64_t pieces, int32_t mechanism,
                             int64_t num_comm_ctas) {
  // With peers, the region holds n - 1 peer blocks of K and of V (ring_attention.h).
  const size_t needed =
      channel.group_size > 1 ? 2 * size_t(channel.group_size - 1) * k.size_bytes() : 0;
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(kOp, kOpRingAttention, ordinal, channel,
                                                    needed, &ctx);
      e.failure())
    return e;
  if (!ring_attention::available()) return ffi_common::built_without_cutlass(kOp);
  const auto t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || k.element_type() != t ||
      v.element_type() != t || out->element_type() != t)
    return invalid("q, k, v and out must all be bfloat16 or all float16");
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] ||
      qd[3] != kd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3])
    return invalid("expected q [B, S, Hq, D] and k, v [B, S, Hkv, D]");
  // The kernel takes each dimension and the ring's tokens (n * S) as int;
  // strides and offsets are 64-bit (kv_walk.cuh: TensorStrides).
  constexpr int64_t kIntMax = INT32_MAX;
  if (qd[0] > kIntMax || qd[1] > kIntMax || qd[2] > kIntMax || qd[3] > kIntMax ||
      kd[2] > kIntMax || qd[1] * channel.group_size > kIntMax)
    return invalid("q, k, v dimensions and the ring's sequence length (" +
                   std::to_string(qd[1]) + " x " + std::to_string(channel.group_size) +
                   " tokens) must each stay below 2^31");

  ring_attention::Params p;
  const ffi_common::Group& g = ctx.group;
  const runtime::DeviceState& d = *g.self;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.batch = int(qd[0]);
  p.q_heads = int(qd[2]);
  p.kv_heads = int(kd[2]);
  p.head_dim = int(qd[3]);
  p.dtype = t == ffi::DataType::BF16 ? ring_attention::DType::kBF16 : ring_attention::DType::kF16;
  p.scale = scale;
  p.geo = ring_attention::Geometry{g.rank, g.n, int(qd[1]), zigzag, causal};
  p.pieces = int(pieces);
  p.skip_post = ctx.skip_post;
  if (mechanism == int32_t(ring_attention::Mechanism::kCopyEngine)) {
    p.mechanism = ring_attention::Mechanism::kCopyEngine;
  } else if (mechanism == int32_t(ring_attention::Mechanism::kLdSt)) {
    if (num_comm_ctas < 1 || num_comm_ctas > ring_attention::kMaxCommCtas)
      return invalid("num_comm_ctas must be 1.." + std::to_string(ring_attention::kMaxCommCtas) +
                     ", got " + std::to_string(num_comm_ctas));
    p.mechanism = ring_attention::Mechanism::kLdSt;
    p.num_comm_ctas = int(num_comm_ctas);
  } else {
    return invalid("unknown mechanism " + std::to_string(mechanism));
  }
  if (!ring_attention::supported(p))
    return invalid("unsupported shape (the Python checks missed it), or k/v not 16-byte aligned");
  for (int r = 0; r < g.n; ++r) p.region[r] = ctx.regions[r];
  p.ch = ctx.channel;
  p.sm_count = d.sm_count;
  static_assert(ffi_common::HasCopyStream<ring_attention::Params>::value,
                "set_streams must give ring attention its copy stream");
  ffi_common::set_streams(&p, stream, d);
  if (cudaError_t err = ring_attention::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RingAttention, RingAttentionImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                        // q [B, S, Hq, D]
        .Arg<ffi::AnyBuffer>()                        // k [B, S, Hkv, D]
        .Arg<ffi::AnyBuffer>()                        // v [B, S, Hkv, D]
        .Ret<ffi::AnyBuffer>()                        // out [B, S, Hq, D]
        .Ret<ffi::Buffer<ffi::F32>>()                 // lse [B, Hq, S]
        .Attr<ffi_common::ChannelAttrs>("channel")    // group, slot, region, timeout
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag")
        .Attr<int64_t>("pieces")
        .Attr<int32_t>("mechanism")                   // ring_attention::Mechanism
        .Attr<int64_t>("num_comm_ctas"),              // ld_st: communicator CTAs
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
