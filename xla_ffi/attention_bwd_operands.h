// The operands both attention backward handlers take (pk_attention_block_bwd,
// pk_ring_attention_bwd), checked once into the block kernel's Params:
//   q, dout [B, S, Hq, D]; lse, delta' [B, Hq, S] f32; k, v [B, T, Hkv, D];
//   q, dout, k and v all bfloat16 or all float16; n, the ring size (global
//   token positions). The kernel takes each dimension and the ring's tokens
//   (n * S, n * T) as int; strides and offsets are 64-bit (kv_walk.cuh:
//   TensorStrides).
// decode_attention_bwd sets the inputs, dimensions, type and n; the outputs,
// ranks, mask and stream are the handler's. attention_bwd_operands() is the
// start of both handlers' FFI binding: the stream, the device ordinal and
// these six operands, in this order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention_bwd/attention_bwd.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"

namespace pk::ffi_handlers {

inline xla::ffi::Error decode_attention_bwd(const char* op, xla::ffi::AnyBuffer q,
                                            xla::ffi::AnyBuffer dout,
                                            xla::ffi::Buffer<xla::ffi::F32> lse,
                                            xla::ffi::Buffer<xla::ffi::F32> delta,
                                            xla::ffi::AnyBuffer k, xla::ffi::AnyBuffer v,
                                            int64_t n, attention_bwd::Params* p) {
  namespace ffi = xla::ffi;
  auto invalid = [op](const char* what) { return ffi_common::invalid_argument(op, what); };
  const auto t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || dout.element_type() != t ||
      k.element_type() != t || v.element_type() != t)
    return invalid("q, dout, k and v must all be bfloat16 or all float16");
  const auto qd = q.dimensions(), od = dout.dimensions(), kd = k.dimensions(),
             vd = v.dimensions(), ld = lse.dimensions(), dd = delta.dimensions();
  if (qd.size() != 4 || od.size() != 4 || kd.size() != 4 || vd.size() != 4 || ld.size() != 3 ||
      dd.size() != 3)
    return invalid("expected q, dout [B, S, Hq, D], lse, delta [B, Hq, S], k, v [B, T, Hkv, D]");
  for (int i = 0; i < 4; ++i) {
    if (od[i] != qd[i]) return invalid("dout must match q");
    if (vd[i] != kd[i]) return invalid("v must match k");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3] || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1] ||
      dd[0] != ld[0] || dd[1] != ld[1] || dd[2] != ld[2])
    return invalid("batch, head dim or lse/delta shapes do not match q");
  constexpr int64_t kIntMax = INT32_MAX;
  if (n < 1 || n > kIntMax) return invalid("the ring size n must be at least 1");
  for (int i = 0; i < 4; ++i)
    if (qd[i] > kIntMax || kd[i] > kIntMax)
      return invalid("dimensions must each stay below 2^31");
  if (qd[1] * n > kIntMax || kd[1] * n > kIntMax)
    return invalid("the ring's sequence length must stay below 2^31");
  p->q = q.untyped_data();
  p->dout = dout.untyped_data();
  p->lse = lse.typed_data();
  p->delta = delta.typed_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->batch = int(qd[0]);
  p->s_q = int(qd[1]);
  p->q_heads = int(qd[2]);
  p->head_dim = int(qd[3]);
  p->s_kv = int(kd[1]);
  p->kv_heads = int(kd[2]);
  p->dtype = t == ffi::DataType::BF16 ? attention_bwd::DType::kBF16 : attention_bwd::DType::kF16;
  p->n = int(n);
  return ffi::Error::Success();
}

// Each handler goes on with its own operands, then its results and attributes.
inline auto attention_bwd_operands() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()          // q [B, S, Hq, D]
      .Arg<ffi::AnyBuffer>()          // dout [B, S, Hq, D]
      .Arg<ffi::Buffer<ffi::F32>>()   // lse [B, Hq, S]
      .Arg<ffi::Buffer<ffi::F32>>()   // delta' [B, Hq, S]
      .Arg<ffi::AnyBuffer>()          // k [B, T, Hkv, D]
      .Arg<ffi::AnyBuffer>();         // v [B, T, Hkv, D]
}

}  // namespace pk::ffi_handlers
