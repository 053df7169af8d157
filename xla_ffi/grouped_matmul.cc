// FFI handler for pk_grouped_matmul: jax.lax.ragged_dot's forward and its two
// gradients on one GPU (csrc/kernels/grouped_matmul).
//
// Operands: a, b (grouped_matmul.h's kinds: kForward lhs [M, K] and rhs
// [G, K, N]; kLhsGrad dout [M, N] and rhs [G, K, N]; kRhsGrad lhs [M, K] and
// dout [M, N]), group_sizes [G] int32 (read on the device).
// Results: out (kForward [M, N], kLhsGrad [M, K], kRhsGrad [G, K, N]) in the
// operands' type, or float32 for kForward; scratch (uint8,
// grouped_matmul::scratch_bytes(G): the per-group arrays and the kernel's
// workspace, so the call needs no allocator and replays from a command
// buffer).
// Attributes: kind (grouped_matmul.h: Kind).
// A local op: no group, no channel; the device's multiprocessor count comes
// from the runtime (set up when the op is lowered).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/grouped_matmul/grouped_matmul.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

using ffi_common::same_dims;

constexpr const char* kOp = "grouped_matmul";

ffi::Error invalid(const std::string& what) { return ffi_common::invalid_argument(kOp, what); }

ffi::Error GroupedMatmulImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::U8>> scratch, int32_t kind) {
  if (!grouped_matmul::available()) return ffi_common::built_without_cutlass(kOp);
  grouped_matmul::Params p;
  if (kind < 0 || kind > 2) return invalid("kind is 0 (forward), 1 (lhs grad) or 2 (rhs grad)");
  p.kind = grouped_matmul::Kind(kind);
  const ffi::DataType t = a.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || b.element_type() != t)
    return invalid("operands must be one type, bfloat16 or float16");
  p.f32_out = out->element_type() == ffi::DataType::F32;
  if (out->element_type() != t && !(p.f32_out && p.kind == grouped_matmul::Kind::kForward))
    return invalid("the result has the operands' type (or float32, forward only)");
  p.type = t == ffi::DataType::BF16 ? DType::kBF16 : DType::kF16;
  if (group_sizes.dimensions().size() != 1) return invalid("group_sizes must be [G]");
  p.groups = int32_t(group_sizes.dimensions()[0]);
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (ad.size() != 2) return invalid("the first operand must be 2-D");
  p.rows = ad[0];
  const int64_t g = p.groups;
  switch (p.kind) {
    case grouped_matmul::Kind::kForward:  // lhs [M, K], rhs [G, K, N] -> [M, N]
      if (bd.size() != 3 || bd[0] != g || bd[1] != ad[1])
        return invalid("expected lhs [M, K] and rhs [G, K, N]");
      p.k = ad[1], p.n = bd[2];
      if (!same_dims(out->dimensions(), {p.rows, p.n})) return invalid("expected out [M, N]");
      break;
    case grouped_matmul::Kind::kLhsGrad:  // dout [M, N], rhs [G, K, N] -> [M, K]
      if (bd.size() != 3 || bd[0] != g || bd[2] != ad[1])
        return invalid("expected dout [M, N] and rhs [G, K, N]");
      p.k = bd[1], p.n = ad[1];
      if (!same_dims(out->dimensions(), {p.rows, p.k})) return invalid("expected out [M, K]");
      break;
    case grouped_matmul::Kind::kRhsGrad:  // lhs [M, K], dout [M, N] -> [G, K, N]
      if (bd.size() != 2 || bd[0] != p.rows) return invalid("expected lhs [M, K] and dout [M, N]");
      p.k = ad[1], p.n = bd[1];
      if (!same_dims(out->dimensions(), {g, p.k, p.n})) return invalid("expected out [G, K, N]");
      break;
  }
  p.group_sizes = group_sizes.typed_data();
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.out = out->untyped_data();
  p.scratch = scratch->untyped_data();
  p.scratch_bytes = scratch->size_bytes();
  const runtime::DeviceState* d = runtime::Runtime::get().by_ordinal(ordinal);
  if (d == nullptr) return invalid("the pk_jax runtime is not set up on this device");
  p.ordinal = ordinal;
  p.sm_count = d->sm_count;
  p.stream = stream;
  if (!grouped_matmul::supported(p))
    return invalid("unsupported shape (the Python checks missed it)");
  if (cudaError_t err = grouped_matmul::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedMatmul, GroupedMatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()            // a (see above)
        .Arg<ffi::AnyBuffer>()            // b
        .Arg<ffi::Buffer<ffi::S32>>()     // group_sizes [G]
        .Ret<ffi::AnyBuffer>()            // out
        .Ret<ffi::Buffer<ffi::U8>>()      // scratch
        .Attr<int32_t>("kind"),           // grouped_matmul.h: Kind
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
