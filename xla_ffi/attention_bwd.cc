// FFI handler for pk_attention_block_bwd: the flash-attention backward of
// one (query block, K/V block) pair of the ring (csrc/kernels/attention_bwd).
//
// Operands: q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; kv
// [2, B, T, Hkv, D] (K and V stacked: the ring moves them as one array);
// q_rank, k_rank (int32 scalars: the ring step is a scan variable, so the K/V
// block's source rank is traced; the kernel reads both ranks on the device).
// Results: dq [B, S, Hq, D], dkv [2, B, T, Hkv, D] (dK and dV), f32.
// Attributes: scale, causal, zigzag, n (ring size, for global positions).
// A local op: no group, no channel, no workspace (dq is its own fp32
// accumulator). dq's reduce-adds make it non-deterministic in the last bits.
// It reads the device's error word, though: while a pk wait on this device
// has failed (and check_errors() has not run) its outputs are NaN, as every
// pk op's are after a failure (a step replayed from a command buffer runs no
// handler that could refuse).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/attention_bwd/attention_bwd.h"
#include "pk/layout.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kOp = "attention_block_bwd";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error AttentionBlockBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                                 ffi::AnyBuffer dout,
                                 ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                                 ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> q_rank,
                                 ffi::Buffer<ffi::S32> k_rank,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dkv, float scale, bool causal,
                                 bool zigzag, int64_t n) {
  if (!attention_bwd::available()) return ffi_common::built_without_cutlass(kOp);
  const auto t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || dout.element_type() != t ||
      kv.element_type() != t)
    return invalid("q, dout and kv must all be bfloat16 or all float16");
  const auto qd = q.dimensions(), od = dout.dimensions(), kvd = kv.dimensions(),
             ld = lse.dimensions(), dd = delta.dimensions(), gd = dkv->dimensions();
  if (qd.size() != 4 || od.size() != 4 || kvd.size() != 5 || kvd[0] != 2 || ld.size() != 3 ||
      dd.size() != 3 || gd.size() != 5)
    return invalid("expected q, dout [B, S, Hq, D], lse, delta [B, Hq, S], kv [2, B, T, Hkv, D]");
  for (int i = 0; i < 4; ++i)
    if (od[i] != qd[i]) return invalid("dout must match q");
  for (int i = 0; i < 5; ++i)
    if (gd[i] != kvd[i]) return invalid("dkv must match kv");
  const int64_t kd[4] = {kvd[1], kvd[2], kvd[3], kvd[4]};  // one of K, V: [B, T, Hkv, D]
  if (kd[0] != qd[0] || kd[3] != qd[3] || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1] ||
      dd[0] != ld[0] || dd[1] != ld[1] || dd[2] != ld[2])
    return invalid("batch, head dim or lse/delta shapes do not match q");
  if (q_rank.element_count() != 1 || k_rank.element_count() != 1 || n < 1)
    return invalid("q_rank and k_rank must be scalars and n >= 1");
  // The kernel takes each dimension and the ring's tokens (n * S, n * T) as
  // int; strides and offsets are 64-bit (kv_walk.cuh: TensorStrides).
  constexpr int64_t kIntMax = INT32_MAX;
  if (n > kIntMax || qd[0] > kIntMax || qd[1] > kIntMax || qd[2] > kIntMax || qd[3] > kIntMax ||
      kd[1] > kIntMax || kd[2] > kIntMax || qd[1] * n > kIntMax || kd[1] * n > kIntMax)
    return invalid("dimensions and the ring's sequence length must each stay below 2^31");
  const size_t half = size_t(kd[0]) * kd[1] * kd[2] * kd[3];  // elements of K (or V)

  attention_bwd::Params p;
  p.q = q.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.k = kv.untyped_data();
  p.v = static_cast<const char*>(kv.untyped_data()) + half * sizeof(uint16_t);  // bf16/fp16
  p.q_rank = q_rank.typed_data();
  p.k_rank = k_rank.typed_data();
  p.dq = dq->typed_data();
  p.dk = dkv->typed_data();
  p.dv = dkv->typed_data() + half;
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
  // Without a runtime (no collective pk op lowered yet) no pk wait can have
  // failed on this device: nothing to poison for.
  if (const runtime::DeviceState* d = runtime::Runtime::get().by_ordinal(ordinal))
    p.claim = &reinterpret_cast<const DeviceHeader*>(d->workspace)->error_claim;
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
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()            // q [B, S, Hq, D]
        .Arg<ffi::AnyBuffer>()            // dout [B, S, Hq, D]
        .Arg<ffi::Buffer<ffi::F32>>()     // lse [B, Hq, S]
        .Arg<ffi::Buffer<ffi::F32>>()     // delta' [B, Hq, S]
        .Arg<ffi::AnyBuffer>()            // kv [2, B, T, Hkv, D]
        .Arg<ffi::Buffer<ffi::S32>>()     // q_rank []
        .Arg<ffi::Buffer<ffi::S32>>()     // k_rank []
        .Ret<ffi::Buffer<ffi::F32>>()     // dq [B, S, Hq, D]
        .Ret<ffi::Buffer<ffi::F32>>()     // dkv [2, B, T, Hkv, D]
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag")
        .Attr<int64_t>("n"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
