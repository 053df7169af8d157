// FFI handler for pk_ring_attention_bwd: the fused ring attention backward
// (csrc/kernels/ring_attention_bwd): one call walks the whole ring, the block
// kernel at each step, K/V and the partial dK/dV moved by the copy engines.
//
// Operands: q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; kv
// [2, B, T, Hkv, D] (our K and V stacked); ranks int32 [n] (ranks[i] = i:
// the block kernel reads its ranks from device memory).
// Results: dq [B, S, Hq, D] f32, dkv [2, B, T, Hkv, D] (q's type: dK and dV
// of our block, summed over the ring), scratch u8 (the local buffers of
// ring_attention_bwd.h's Layout; nothing reads it afterwards).
// Attributes: channel (group, slot, region, timeout), scale, causal, zigzag.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/ring_attention_bwd/ring_attention_bwd.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "ring_attention_bwd";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error RingAttentionBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                                ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                                ffi::Buffer<ffi::F32> delta, ffi::AnyBuffer kv,
                                ffi::Buffer<ffi::S32> ranks,
                                ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                ffi::Result<ffi::AnyBuffer> dkv,
                                ffi::Result<ffi::AnyBuffer> scratch,
                                ffi_common::ChannelAttrs channel, float scale, bool causal,
                                bool zigzag) {
  const auto qd = q.dimensions(), od = dout.dimensions(), kvd = kv.dimensions(),
             ld = lse.dimensions(), dd = delta.dimensions(), gd = dkv->dimensions();
  if (qd.size() != 4 || od.size() != 4 || kvd.size() != 5 || kvd[0] != 2 || ld.size() != 3 ||
      dd.size() != 3 || gd.size() != 5)
    return invalid("expected q, dout [B, S, Hq, D], lse, delta [B, Hq, S], kv [2, B, T, Hkv, D]");
  constexpr int64_t kIntMax = INT32_MAX;
  for (int i = 0; i < 4; ++i)
    if (qd[i] > kIntMax || kvd[i + 1] > kIntMax)
      return invalid("dimensions must each stay below 2^31");
  const ring_attention_bwd::Layout L = ring_attention_bwd::make_layout(
      int(std::min<int64_t>(channel.group_size, kIntMax)), int(kvd[1]), int(kvd[2]),
      int(kvd[3]), int(kvd[4]));
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(kOp, kOpRingAttentionBwd, ordinal, channel,
                                                    L.region_bytes(), &ctx);
      e.failure())
    return e;
  if (!ring_attention_bwd::available()) return ffi_common::built_without_cutlass(kOp);
  const ffi_common::Group& g = ctx.group;
  if (g.n < 2) return invalid("the fused backward needs a ring of at least 2 ranks");
  const auto t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || dout.element_type() != t ||
      kv.element_type() != t || dkv->element_type() != t)
    return invalid("q, dout, kv and dkv must all be bfloat16 or all float16");
  for (int i = 0; i < 4; ++i)
    if (od[i] != qd[i]) return invalid("dout must match q");
  for (int i = 0; i < 5; ++i)
    if (gd[i] != kvd[i]) return invalid("dkv must match kv");
  if (kvd[1] != qd[0] || kvd[4] != qd[3] || ld[0] != qd[0] || ld[1] != qd[2] ||
      ld[2] != qd[1] || dd[0] != ld[0] || dd[1] != ld[1] || dd[2] != ld[2])
    return invalid("batch, head dim or lse/delta shapes do not match q");
  if (ranks.element_count() != size_t(g.n))
    return invalid("ranks must hold the ring's " + std::to_string(g.n) + " ranks");
  if (scratch->size_bytes() < L.scratch_bytes())
    return invalid("scratch holds " + std::to_string(scratch->size_bytes()) + " bytes, " +
                   std::to_string(L.scratch_bytes()) + " needed");
  // The kernel takes the ring's tokens (n * S, n * T) as int.
  if (qd[1] * g.n > kIntMax || kvd[2] * g.n > kIntMax)
    return invalid("the ring's sequence length must stay below 2^31");

  ring_attention_bwd::Params p;
  const runtime::DeviceState& d = *g.self;
  p.q = q.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.kv = kv.untyped_data();
  p.ranks = ranks.typed_data();
  p.dq = dq->typed_data();
  p.dkv = dkv->untyped_data();
  p.scratch = static_cast<char*>(scratch->untyped_data());
  p.batch = int(qd[0]);
  p.s_q = int(qd[1]);
  p.q_heads = int(qd[2]);
  p.head_dim = int(qd[3]);
  p.s_kv = int(kvd[2]);
  p.kv_heads = int(kvd[3]);
  p.dtype = t == ffi::DataType::BF16 ? DType::kBF16 : DType::kF16;
  p.scale = scale;
  p.causal = causal;
  p.zigzag = zigzag;
  p.skip_post = ctx.skip_post;
  p.ch = ctx.channel;
  for (int r = 0; r < g.n; ++r) p.region[r] = ctx.regions[r];
  if (!ring_attention_bwd::supported(p))
    return invalid("unsupported shape (the Python checks missed it)");
  p.stream = stream;
  p.side_stream = d.side_stream;
  p.fork = d.fork;
  p.join = d.join;
  if (cudaError_t err = ring_attention_bwd::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RingAttentionBwd, RingAttentionBwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                        // q [B, S, Hq, D]
        .Arg<ffi::AnyBuffer>()                        // dout [B, S, Hq, D]
        .Arg<ffi::Buffer<ffi::F32>>()                 // lse [B, Hq, S]
        .Arg<ffi::Buffer<ffi::F32>>()                 // delta' [B, Hq, S]
        .Arg<ffi::AnyBuffer>()                        // kv [2, B, T, Hkv, D]
        .Arg<ffi::Buffer<ffi::S32>>()                 // ranks [n]
        .Ret<ffi::Buffer<ffi::F32>>()                 // dq [B, S, Hq, D]
        .Ret<ffi::AnyBuffer>()                        // dkv [2, B, T, Hkv, D]
        .Ret<ffi::AnyBuffer>()                        // scratch (u8)
        .Attr<ffi_common::ChannelAttrs>("channel")    // group, slot, region, timeout
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
