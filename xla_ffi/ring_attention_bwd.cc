// FFI handler for pk_ring_attention_bwd: the fused ring attention backward
// (csrc/kernels/ring_attention_bwd): one call walks the whole ring, the block
// kernel at each step, K/V and the partial dK/dV moved by the copy engines.
//
// Operands: q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; k, v
// [B, T, Hkv, D] (our block; checked by decode_attention_bwd); ranks int32
// [n] (ranks[i] = i: the block kernel reads its ranks from device memory).
// Results: dq [B, S, Hq, D] f32; dk, dv [B, T, Hkv, D] (k's type: the
// gradients of our block, summed over the ring); scratch u8 (the local
// buffers of ring_attention_bwd.h's Layout; nothing reads it afterwards).
// Attributes: channel (group, slot, region, timeout), scale, causal, zigzag.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/ring_attention_bwd/ring_attention_bwd.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/attention_bwd_operands.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

using ffi_common::same_dims;

constexpr const char* kOp = "ring_attention_bwd";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error RingAttentionBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                                ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                                ffi::Buffer<ffi::F32> delta, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> ranks,
                                ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                ffi::Result<ffi::AnyBuffer> scratch,
                                ffi_common::ChannelAttrs channel, float scale, bool causal,
                                bool zigzag) {
  ring_attention_bwd::Params p;
  if (ffi::Error e = decode_attention_bwd(kOp, q, dout, lse, delta, k, v,
                                          std::max<int64_t>(channel.group_size, 1), &p.block);
      e.failure())
    return e;
  const ring_attention_bwd::Layout L = ring_attention_bwd::make_layout(
      p.block.n, p.block.batch, p.block.s_kv, p.block.kv_heads, p.block.head_dim);
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(kOp, kOpRingAttentionBwd, ordinal, channel,
                                                    L.region_bytes(), &ctx);
      e.failure())
    return e;
  if (!ring_attention_bwd::available()) return ffi_common::built_without_cutlass(kOp);
  const ffi_common::Group& g = ctx.group;
  if (g.n < 2) return invalid("the fused backward needs a ring of at least 2 ranks");
  if (!same_dims(dq->dimensions(), q.dimensions())) return invalid("dq must match q");
  if (dk->element_type() != k.element_type() || dv->element_type() != k.element_type() ||
      !same_dims(dk->dimensions(), k.dimensions()) || !same_dims(dv->dimensions(), k.dimensions()))
    return invalid("dk and dv must match k (shape and type)");
  if (ranks.element_count() != size_t(g.n))
    return invalid("ranks must hold the ring's " + std::to_string(g.n) + " ranks");
  if (scratch->size_bytes() < L.scratch_bytes())
    return invalid("scratch holds " + std::to_string(scratch->size_bytes()) + " bytes, " +
                   std::to_string(L.scratch_bytes()) + " needed");

  const runtime::DeviceState& d = *g.self;
  p.block.scale = scale;
  p.block.causal = causal;
  p.block.zigzag = zigzag;
  p.ranks = ranks.typed_data();
  p.dq = dq->typed_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.scratch = static_cast<char*>(scratch->untyped_data());
  p.skip_post = ctx.skip_post;
  p.ch = ctx.channel;
  for (int r = 0; r < g.n; ++r) p.region[r] = ctx.regions[r];
  if (!ring_attention_bwd::supported(p))
    return invalid("unsupported shape (the Python checks missed it)");
  ffi_common::set_streams(&p, stream, d);
  if (cudaError_t err = ring_attention_bwd::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RingAttentionBwd, RingAttentionBwdImpl,
    attention_bwd_operands()                          // stream, ordinal, q, dout, lse, delta', k, v
        .Arg<ffi::Buffer<ffi::S32>>()                 // ranks [n]
        .Ret<ffi::Buffer<ffi::F32>>()                 // dq [B, S, Hq, D]
        .Ret<ffi::AnyBuffer>()                        // dk [B, T, Hkv, D], k's type
        .Ret<ffi::AnyBuffer>()                        // dv, as dk
        .Ret<ffi::AnyBuffer>()                        // scratch (u8)
        .Attr<ffi_common::ChannelAttrs>("channel")    // group, slot, region, timeout
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
