// FFI handler for pk_attention_block_bwd: the flash-attention backward of
// one (query block, K/V block) pair of the ring (csrc/kernels/attention_bwd).
//
// Operands: q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; k, v
// [B, T, Hkv, D]; q_rank, k_rank (int32 scalars: the ring step is a scan
// variable, so the K/V block's source rank is traced; the kernel reads both
// ranks on the device). Results: dq [B, S, Hq, D], dk, dv [B, T, Hkv, D], f32.
// Attributes: scale, causal, zigzag, n (ring size, for global positions).
// A local op: no group, no channel, no workspace (dq is its own fp32
// accumulator). dq's reduce-adds make it non-deterministic in the last bits.
#include <cuda_runtime.h>

#include <string>

#include "kernels/attention_bwd/attention_bwd.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "attention_block_bwd";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error AttentionBlockBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer dout,
                                 ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                                 ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> q_rank, ffi::Buffer<ffi::S32> k_rank,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dk,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dv, float scale, bool causal,
                                 bool zigzag, int64_t n) {
  if (!attention_bwd::available()) return ffi_common::built_without_cutlass(kOp);
  const auto t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || dout.element_type() != t ||
      k.element_type() != t || v.element_type() != t)
    return invalid("q, dout, k and v must all be bfloat16 or all float16");
  const auto qd = q.dimensions(), od = dout.dimensions(), kd = k.dimensions(),
             vd = v.dimensions(), ld = lse.dimensions(), dd = delta.dimensions();
  if (qd.size() != 4 || od.size() != 4 || kd.size() != 4 || vd.size() != 4 ||
      ld.size() != 3 || dd.size() != 3)
    return invalid("expected q, dout [B, S, Hq, D], lse, delta [B, Hq, S], k, v [B, T, Hkv, D]");
  for (int i = 0; i < 4; ++i)
    if (od[i] != qd[i] || vd[i] != kd[i]) return invalid("dout must match q and v must match k");
  if (kd[0] != qd[0] || kd[3] != qd[3] || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1] ||
      dd[0] != ld[0] || dd[1] != ld[1] || dd[2] != ld[2])
    return invalid("batch, head dim or lse/delta shapes do not match q");
  if (q_rank.element_count() != 1 || k_rank.element_count() != 1 || n < 1)
    return invalid("q_rank and k_rank must be scalars and n >= 1");

  attention_bwd::Params p;
  p.q = q.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.q_rank = q_rank.typed_data();
  p.k_rank = k_rank.typed_data();
  p.dq = dq->typed_data();
  p.dk = dk->typed_data();
  p.dv = dv->typed_data();
  p.batch = int(qd[0]);
  p.s_q = int(qd[1]);
  p.q_heads = int(qd[2]);
  p.head_dim = int(qd[3]);
  p.s_kv = int(kd[1]);
  p.kv_heads = int(kd[2]);
  p.dtype = t == ffi::DataType::BF16 ? attention_bwd::DType::kBF16 : attention_bwd::DType::kF16;
  p.scale = scale;
  p.causal = causal;
  p.zigzag = zigzag;
  p.n = int(n);
  p.stream = stream;
  if (!attention_bwd::supported(p)) return invalid("unsupported shape (the Python checks missed it)");
  if (cudaError_t err = attention_bwd::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttentionBlockBwd, AttentionBlockBwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()            // q [B, S, Hq, D]
        .Arg<ffi::AnyBuffer>()            // dout [B, S, Hq, D]
        .Arg<ffi::Buffer<ffi::F32>>()     // lse [B, Hq, S]
        .Arg<ffi::Buffer<ffi::F32>>()     // delta' [B, Hq, S]
        .Arg<ffi::AnyBuffer>()            // k [B, T, Hkv, D]
        .Arg<ffi::AnyBuffer>()            // v [B, T, Hkv, D]
        .Arg<ffi::Buffer<ffi::S32>>()     // q_rank []
        .Arg<ffi::Buffer<ffi::S32>>()     // k_rank []
        .Ret<ffi::Buffer<ffi::F32>>()     // dq [B, S, Hq, D]
        .Ret<ffi::Buffer<ffi::F32>>()     // dk [B, T, Hkv, D]
        .Ret<ffi::Buffer<ffi::F32>>()     // dv [B, T, Hkv, D]
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag")
        .Attr<int64_t>("n"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
