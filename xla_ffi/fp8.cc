// FFI handlers of pk_jax's FP8 op: pk_fp8_quantize (csrc/kernels/fp8) and
// pk_fp8_matmul (the scaled FP8 GEMMs of csrc/kernels/gemm), both local to
// one GPU (no group, no channel).
//
// pk_fp8_quantize
//   Operands: x [R, C] (bf16, f16 or f32); scale [1] f32 (read only with
//     given_scale: delayed scaling's scale).
//   Results: q [R, C] (e4m3 or e5m2; [0, 0] when not asked for), qt [C, R]
//     (the transposed copy; [0, 0] when not asked for), factors (f32, fp8.h's
//     layout of the granularity; q's per 1x128 [row_groups * ceil(C / 128),
//     R / row_groups]), factors_t (f32: qt's for kRowsCols [ceil(R / 128),
//     C] and kRowsBlocks [ceil(R / 128), ceil(C / 128)]; [0] otherwise),
//     amax [1] f32 (kTensor; [0] otherwise).
//   Attributes: granularity (fp8.h: Granularity), given_scale, margin,
//     row_groups (the row groups of q's 1x128 factors, fp8.h: row_factors();
//     1 otherwise).
// pk_fp8_matmul
//   Operands: a [M, K], b [N, K] (FP8, K-major both), scale_a, scale_b (f32,
//     gemm.h: Scaling's layouts).
//   Results: out [M, N] bf16 or f32.
//   Attributes: scaling (gemm.h: Scaling, kTensor or kBlock), b_row_blocks,
//     library (gemm.h: Library: who runs the GEMM), fast_accum (per-tensor
//     products with an e5m2 operand without fp32 promotion where cuBLASLt
//     runs them: gemm::Problem::fast_accum).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/fp8/fp8.h"
#include "kernels/gemm/gemm.h"
#include "runtime/workspace.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

using ffi_common::same_dims;
using ffi_common::to_dtype;

int64_t blocks(int64_t extent) { return (extent + fp8::kBlock - 1) / fp8::kBlock; }

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::Buffer<ffi::F32>> factors,
                        ffi::Result<ffi::Buffer<ffi::F32>> factors_t,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax, int32_t granularity,
                        bool given_scale, float margin, int32_t row_groups) {
  constexpr const char* kOp = "fp8_quantize";
  auto invalid = [](const std::string& what) { return ffi_common::invalid_argument(kOp, what); };
  fp8::Quantize p;
  const auto xd = x.dimensions();
  if (xd.size() != 2) return invalid("x must be 2-D");
  p.rows = xd[0];
  p.cols = xd[1];
  if (!to_dtype(x.element_type(), &p.in) || is_fp8(p.in))
    return invalid("x must be bfloat16, float16 or float32");
  if (granularity < 0 || granularity > 5)
    return invalid("granularity is 0 (tensor), 1 (rows), 2 (cols), 3 (blocks), 4 (rows_cols) "
                   "or 5 (rows_blocks)");
  p.granularity = fp8::Granularity(granularity);
  if (row_groups < 1 || (row_groups > 1 && !fp8::row_factors(p.granularity)) ||
      p.rows % row_groups != 0)
    return invalid("row_groups must be 1, or with factors per 1x128 rows a divisor of R (got " +
                   std::to_string(row_groups) + " for R = " + std::to_string(p.rows) + ")");
  p.row_groups = row_groups;
  const bool rowwise = q->element_count() > 0, transposed = qt->element_count() > 0;
  const ffi::DataType out_type = rowwise ? q->element_type() : qt->element_type();
  if (!to_dtype(out_type, &p.out) || !is_fp8(p.out) ||
      (rowwise && transposed && q->element_type() != qt->element_type()))
    return invalid("q and qt must be one FP8 type, float8_e4m3fn or float8_e5m2");
  if (rowwise && !same_dims(q->dimensions(), {p.rows, p.cols})) return invalid("expected q [R, C]");
  if (transposed && !same_dims(qt->dimensions(), {p.cols, p.rows}))
    return invalid("expected qt [C, R]");
  const int64_t per_rows = blocks(p.cols) * p.rows, per_cols = blocks(p.rows) * p.cols,
                per_blocks = blocks(p.rows) * blocks(p.cols);  // any row_groups
  int64_t want = 1, want_t = 0;
  switch (p.granularity) {
    case fp8::Granularity::kTensor: want = 1; break;
    case fp8::Granularity::kRows: want = per_rows; break;
    case fp8::Granularity::kCols: want = per_cols; break;
    case fp8::Granularity::kBlocks: want = per_blocks; break;
    case fp8::Granularity::kRowsCols: want = per_rows, want_t = per_cols; break;
    case fp8::Granularity::kRowsBlocks: want = per_rows, want_t = per_blocks; break;
  }
  if (int64_t(factors->element_count()) != want || int64_t(factors_t->element_count()) != want_t)
    return invalid("factors have the wrong size");
  const bool tensor = p.granularity == fp8::Granularity::kTensor;
  if (int64_t(amax->element_count()) != (tensor ? 1 : 0))
    return invalid("amax is [1] for tensor granularity, [0] otherwise");
  if (given_scale && (!tensor || scale.element_count() != 1))
    return invalid("a given scale is one float32, with tensor granularity");
  p.x = x.untyped_data();
  p.q = rowwise ? q->untyped_data() : nullptr;
  p.qt = transposed ? qt->untyped_data() : nullptr;
  p.factors = factors->typed_data();
  p.factors_t = fp8::two_factors(p.granularity) ? factors_t->typed_data() : nullptr;
  p.scale = given_scale ? scale.typed_data() : nullptr;
  p.amax = tensor ? amax->typed_data() : nullptr;
  p.margin = margin;
  p.stream = stream;
  if (fp8::check(p) != cudaSuccess)
    return invalid("unsupported combination of granularity and outputs (the Python checks missed it)");
  if (cudaError_t err = fp8::run(p); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Buffer<ffi::F32> scale_a, ffi::Buffer<ffi::F32> scale_b,
                      ffi::Result<ffi::AnyBuffer> out, int32_t scaling, bool b_row_blocks,
                      int32_t library, bool fast_accum) {
  constexpr const char* kOp = "fp8_matmul";
  auto invalid = [](const std::string& what) { return ffi_common::invalid_argument(kOp, what); };
  if (!gemm::available()) return ffi_common::built_without_cutlass(kOp);
  gemm::Problem g;
  if (!to_dtype(a.element_type(), &g.in) || !to_dtype(b.element_type(), &g.in_b) ||
      !is_fp8(g.in) || !is_fp8(g.in_b))
    return invalid("a and b must be float8_e4m3fn or float8_e5m2");
  if (!to_dtype(out->element_type(), &g.out) || (g.out != DType::kBF16 && g.out != DType::kF32))
    return invalid("the result must be bfloat16 or float32");
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1])
    return invalid("expected a [M, K] and b [N, K]");
  g.m = ad[0];
  g.k = ad[1];
  g.n = bd[0];
  if (!same_dims(out->dimensions(), {g.m, g.n})) return invalid("expected out [M, N]");
  ffi_common::Fp8Gemm fp8;
  if (ffi::Error e = ffi_common::read_fp8_gemm(kOp, scaling, library, fast_accum, &fp8);
      e.failure())
    return e;
  g.scaling = fp8.scaling;
  g.library = fp8.library;
  g.fast_accum = fp8.fast_accum;
  g.b_row_blocks = b_row_blocks;
  const int64_t kb = blocks(g.k);
  const bool block = g.scaling == gemm::Scaling::kBlock;
  const int64_t want_a = block ? kb * g.m : 1;
  const int64_t want_b = block ? kb * (b_row_blocks ? g.n : blocks(g.n)) : 1;
  if (int64_t(scale_a.element_count()) != want_a || int64_t(scale_b.element_count()) != want_b)
    return invalid("the scale factors have the wrong size for the scaling");
  g.a = a.untyped_data();
  g.b = b.untyped_data();
  g.b_transposed = true;
  g.d = out->untyped_data();
  g.scale_a = scale_a.typed_data();
  g.scale_b = scale_b.typed_data();
  if (!gemm::supported(g)) return invalid("unsupported shape or types (the Python checks missed it)");
  const runtime::DeviceState* d = runtime::Runtime::get().by_ordinal(ordinal);
  if (d == nullptr) return invalid("the pk_jax runtime is not set up on this device");
  const gemm::Device dev{d->ordinal, d->sm_count, d->gemm_workspace, d->gemm_workspace_bytes};
  if (cudaError_t err = gemm::run(g, dev, stream); err != cudaSuccess)
    return ffi_common::cuda_error(kOp, "launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Fp8Quantize, QuantizeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()                // x [R, C]
        .Arg<ffi::Buffer<ffi::F32>>()         // scale [1] (given_scale)
        .Ret<ffi::AnyBuffer>()                // q [R, C] or [0, 0]
        .Ret<ffi::AnyBuffer>()                // qt [C, R] or [0, 0]
        .Ret<ffi::Buffer<ffi::F32>>()         // factors
        .Ret<ffi::Buffer<ffi::F32>>()         // factors_t ([0] but for two factor layouts)
        .Ret<ffi::Buffer<ffi::F32>>()         // amax [1] or [0]
        .Attr<int32_t>("granularity")         // fp8.h: Granularity
        .Attr<bool>("given_scale")
        .Attr<float>("margin")
        .Attr<int32_t>("row_groups"),         // kRows: fp8.h's row groups
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Fp8Matmul, MatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                // a [M, K] FP8
        .Arg<ffi::AnyBuffer>()                // b [N, K] FP8
        .Arg<ffi::Buffer<ffi::F32>>()         // scale_a
        .Arg<ffi::Buffer<ffi::F32>>()         // scale_b
        .Ret<ffi::AnyBuffer>()                // out [M, N]
        .Attr<int32_t>("scaling")             // gemm.h: Scaling
        .Attr<bool>("b_row_blocks")
        .Attr<int32_t>("library")             // gemm.h: Library
        .Attr<bool>("fast_accum"),            // gemm::Problem::fast_accum
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
