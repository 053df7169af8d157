// FFI handler for pk_attention_block_bwd: the flash-attention backward of
// one (query block, K/V block) pair of the ring (csrc/kernels/attention_bwd).
//
// Operands: q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; k, v
// [B, T, Hkv, D]; q_rank, k_rank (int32 scalars: the ring step is a scan
// variable, so the K/V block's source rank is traced; the kernel reads both
// ranks on the device). Checked by decode_attention_bwd.
// Results: dq [B, S, Hq, D] f32; dk, dv [B, T, Hkv, D], f32 (a ring step's
// share, summed later) or the input type (a ring of one: the gradients).
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
#include "xla_ffi/attention_bwd_operands.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

using ffi_common::same_dims;

constexpr const char* kOp = "attention_block_bwd";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error AttentionBlockBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                                 ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                                 ffi::Buffer<ffi::F32> delta, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::Buffer<ffi::S32> q_rank, ffi::Buffer<ffi::S32> k_rank,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 float scale, bool causal, bool zigzag, int64_t n) {
  if (!attention_bwd::available()) return ffi_common::built_without_cutlass(kOp);
  attention_bwd::Params p;
  if (ffi::Error e = decode_attention_bwd(kOp, q, dout, lse, delta, k, v, n, &p); e.failure())
    return e;
  if (!same_dims(dq->dimensions(), q.dimensions())) return invalid("dq must match q");
  const auto grad_type = dk->element_type();
  if (grad_type != ffi::DataType::F32 && grad_type != k.element_type())
    return invalid("dk and dv must be float32 or k's type");
  if (dv->element_type() != grad_type || !same_dims(dk->dimensions(), k.dimensions()) ||
      !same_dims(dv->dimensions(), k.dimensions()))
    return invalid("dk and dv must match k, both of one type");
  if (q_rank.element_count() != 1 || k_rank.element_count() != 1)
    return invalid("q_rank and k_rank must be scalars");
  p.q_rank = q_rank.typed_data();
  p.k_rank = k_rank.typed_data();
  p.dq = dq->typed_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dkv_in_input_type = grad_type != ffi::DataType::F32;
  p.scale = scale;
  p.causal = causal;
  p.zigzag = zigzag;
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
    attention_bwd_operands()              // stream, ordinal, q, dout, lse, delta', k, v
        .Arg<ffi::Buffer<ffi::S32>>()     // q_rank []
        .Arg<ffi::Buffer<ffi::S32>>()     // k_rank []
        .Ret<ffi::Buffer<ffi::F32>>()     // dq [B, S, Hq, D]
        .Ret<ffi::AnyBuffer>()            // dk [B, T, Hkv, D], f32 or k's type
        .Ret<ffi::AnyBuffer>()            // dv, as dk
        .Attr<float>("scale")
        .Attr<bool>("causal")
        .Attr<bool>("zigzag")
        .Attr<int64_t>("n"),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
