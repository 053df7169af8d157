// FFI handlers for pk_jax.all_gather_matmul, pk_jax.matmul_reduce_scatter and
// pk_jax.matmul_all_reduce, and the backward passes of the first two (dx and
// dw in one call: the other op's sequence with the weight gradient's GEMM
// placed where it would wait); the three forward sequences on FP8 operands
// with per-tensor or block factors (the *_fp8 targets: fp8= of the TP ops).
#include <cuda_runtime.h>

#include <string>

#include "kernels/tp_matmul/tp_matmul.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

// The factors of FP8 operands (the *_fp8 targets), their scaling (the
// attribute `scaling`, gemm.h: Scaling, kTensor or kBlock) and who runs the
// per-tensor GEMMs (`library`, gemm.h: Library) and how they accumulate
// (`fast_accum`, gemm::Problem::fast_accum).
struct Fp8Factors {
  ffi::AnyBuffer x, w;
  int32_t scaling;
  int32_t library;
  bool fast_accum;
};

// Operand types: x and w of one 16-bit type; or, with factors, both FP8
// (not both e5m2; e4m3 both with block factors) and the scaling.
ffi::Error read_types(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer out,
                      const Fp8Factors* fp8, tp_matmul::Params* p) {
  using ffi_common::to_dtype;
  if (!to_dtype(x.element_type(), &p->in) || !to_dtype(w.element_type(), &p->in_w) ||
      !to_dtype(out.element_type(), &p->out_type))
    return ffi_common::invalid_argument(op, "unsupported dtypes");
  if (fp8 == nullptr) {
    if (gemm::is_fp8(p->in) || x.element_type() != w.element_type())
      return ffi_common::invalid_argument(op, "x and w must have one 16-bit dtype");
    return ffi::Error::Success();
  }
  if (!gemm::is_fp8(p->in) || !gemm::is_fp8(p->in_w))
    return ffi_common::invalid_argument(op, "the FP8 target takes FP8 x and w");
  ffi_common::Fp8Gemm gemm_attrs;
  if (ffi::Error e = ffi_common::read_fp8_gemm(op, fp8->scaling, fp8->library, fp8->fast_accum,
                                               &gemm_attrs);
      e.failure())
    return e;
  p->scaling = gemm_attrs.scaling;
  p->library = gemm_attrs.library;
  p->fast_accum = gemm_attrs.fast_accum;
  if (tp_matmul::block_scaled(*p) && (p->in != DType::kE4M3 || p->in_w != DType::kE4M3))
    return ffi_common::invalid_argument(op, "block factors take float8_e4m3fn x and w");
  return ffi::Error::Success();
}

// The dimensions of a factor buffer, as text for the errors.
std::string dims_text(ffi::AnyBuffer f) {
  std::string text = "[";
  for (int64_t d : f.dimensions()) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

// The factors of FP8 operands, once the shapes are read (p->k, p->n_cols):
// float32, one each (kTensor), or block factors: x's `x_rows` rows per 1x128
// in `groups` row groups [groups * ceil(K / 128), x_rows / groups] (the rows
// of each of the sequence's GEMMs: tp_matmul.h, Params::scale_x), w's per
// 128x128 [ceil(K / 128), ceil(N / 128)]. Nothing without FP8 operands.
ffi::Error read_factors(const char* op, const Fp8Factors* fp8, int64_t x_rows, int64_t groups,
                        tp_matmul::Params* p) {
  if (fp8 == nullptr) return ffi::Error::Success();
  if (fp8->x.element_type() != ffi::DataType::F32 || fp8->w.element_type() != ffi::DataType::F32)
    return ffi_common::invalid_argument(op, "the factors must be float32");
  if (!tp_matmul::block_scaled(*p)) {
    if (fp8->x.element_count() != 1 || fp8->w.element_count() != 1)
      return ffi_common::invalid_argument(op, "expected one float32 factor per operand");
  } else {
    const int64_t kb = gemm::scale_blocks(p->k), nb = gemm::scale_blocks(p->n_cols);
    const bool x_ok = x_rows % groups == 0 &&
                      ffi_common::same_dims(fp8->x.dimensions(), {groups * kb, x_rows / groups});
    const bool w_ok = ffi_common::same_dims(fp8->w.dimensions(), {kb, nb});
    if (!x_ok || !w_ok)
      return ffi_common::invalid_argument(
          op, "expected block factors x [" + std::to_string(groups * kb) + ", " +
                  std::to_string(x_rows / groups) + "] (per 1x128, " + std::to_string(groups) +
                  " row groups) and w [" + std::to_string(kb) + ", " +
                  std::to_string(nb) + "] (per 128x128), got " +
                  dims_text(fp8->x) + " and " + dims_text(fp8->w));
  }
  p->scale_x = static_cast<const float*>(fp8->x.untyped_data());
  p->scale_w = static_cast<const float*>(fp8->w.untyped_data());
  return ffi::Error::Success();
}

// Everything both ops share: the group and its channel (`needed` bytes
// staged in the region), dtypes (with FP8 operands, their factors), streams.
ffi::Error prepare(const char* op, int32_t op_id, cudaStream_t stream, int32_t ordinal,
                   ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer out,
                   const ffi_common::ChannelAttrs& channel, size_t needed, tp_matmul::Params* p,
                   const Fp8Factors* fp8 = nullptr) {
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(op, op_id, ordinal, channel, needed, &ctx);
      e.failure())
    return e;
  if (!gemm::available()) return ffi_common::built_without_cutlass(op);
  if (ffi::Error e = read_types(op, x, w, out, fp8, p); e.failure()) return e;
  const ffi_common::Group& g = ctx.group;
  const runtime::DeviceState& d = *g.self;
  p->rank = g.rank;
  p->n = g.n;
  for (int q = 0; q < g.n; ++q) p->region[q] = ctx.regions[q];
  p->ch = ctx.channel;
  p->skip_post = ctx.skip_post;
  p->gemm_dev = {d.ordinal, d.sm_count, d.gemm_workspace, d.gemm_workspace_bytes};
  ffi_common::set_streams(p, stream, d);
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

// w [K, N], or [N, K] when w_transposed (the backward's w^T, not copied).
bool read_w(ffi::AnyBuffer w, bool w_transposed, int64_t* k, int64_t* n_cols,
            tp_matmul::Params* p) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return false;
  *k = w_transposed ? wd[1] : wd[0];
  *n_cols = w_transposed ? wd[0] : wd[1];
  p->w_transposed = w_transposed;
  return true;
}

ffi::Error launched(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi_common::cuda_error(op, "launch", err);
}

// The weight gradient of a backward call: dw [N, K] of the forward's
// activations act [n * m, N] (tp_matmul.h: weight_grad), both the input type.
ffi::Error read_weight_grad(const char* op, ffi::AnyBuffer act, ffi::AnyBuffer dw,
                            ffi::AnyBuffer x, tp_matmul::Params* p) {
  const auto ad = act.dimensions();
  const auto dd = dw.dimensions();
  if (act.element_type() != x.element_type() || dw.element_type() != x.element_type())
    return ffi_common::invalid_argument(op, "act and dw must have the operands' dtype");
  if (ad.size() != 2 || ad[0] != int64_t(p->n) * p->m || ad[1] != p->n_cols || dd.size() != 2 ||
      dd[0] != p->n_cols || dd[1] != p->k)
    return ffi_common::invalid_argument(op, "expected act [n * m, N] and dw [N, K]");
  p->act = act.untyped_data();
  p->dw = dw.untyped_data();
  return ffi::Error::Success();
}

// all_gather_matmul's call (the forward, or with act/dw the backward of
// matmul_reduce_scatter) after `prepare`: x [m, K], w, out [n*m, N].
ffi::Error read_all_gather_matmul(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  ffi::AnyBuffer out, bool w_transposed,
                                  tp_matmul::Params* p) {
  const auto xd = x.dimensions();
  int64_t wk = 0;
  if (xd.size() != 2 || !read_w(w, w_transposed, &wk, &p->n_cols, p) || xd[1] != wk)
    return ffi_common::invalid_argument(op, "expected x [m, K], w [K, N] (or [N, K] transposed)");
  p->m = xd[0];
  p->k = xd[1];
  if (out.size_bytes() != size_t(p->n) * p->m * p->n_cols * gemm::itemsize(p->out_type))
    return ffi_common::invalid_argument(op, "expected out [n * m, N]");
  return ffi::Error::Success();
}

// With peers, the region holds every rank's x, each followed by its block
// factors ([ceil(K / 128), m] float32, with block FP8 factors; tp_matmul.h).
size_t all_gather_matmul_region(const ffi_common::ChannelAttrs& channel, ffi::AnyBuffer x,
                                const Fp8Factors* fp8 = nullptr) {
  if (channel.group_size <= 1) return 0;
  const auto xd = x.dimensions();
  size_t slot = x.size_bytes();
  if (fp8 != nullptr && fp8->scaling == int32_t(gemm::Scaling::kBlock) && xd.size() == 2)
    slot += size_t(xd[0]) * size_t(gemm::scale_blocks(xd[1])) * sizeof(float);
  return size_t(channel.group_size) * slot;
}

// The forward (16-bit operands, or FP8 with their factors); gathered: null,
// or the buffer of the gathered x.
ffi::Error all_gather_matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::AnyBuffer w, const Fp8Factors* fp8, ffi::AnyBuffer out,
                             ffi::AnyBuffer* gathered, const ffi_common::ChannelAttrs& channel,
                             bool w_transposed) {
  const char* op = fp8 ? "all_gather_matmul (fp8)" : "all_gather_matmul";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(op, kOpAllGatherMatmul, stream, ordinal, x, w, out, channel,
                             all_gather_matmul_region(channel, x, fp8), &p, fp8);
      e.failure())
    return e;
  if (ffi::Error e = read_all_gather_matmul(op, x, w, out, w_transposed, &p); e.failure())
    return e;
  if (ffi::Error e = read_factors(op, fp8, p.m, 1, &p); e.failure()) return e;
  if (gathered != nullptr && gathered->size_bytes() != size_t(p.n) * x.size_bytes())
    return ffi_common::invalid_argument(op, "expected gathered [n * m, K]");
  p.gathered = gathered != nullptr ? gathered->untyped_data() : nullptr;
  p.op = tp_matmul::Op::kAllGatherMatmul;
  return launched(op, tp_matmul::run(p));
}

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                               ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> gathered,
                               ffi_common::ChannelAttrs channel, bool return_gathered,
                               bool w_transposed) {
  ffi::AnyBuffer gathered_buffer = *gathered;
  return all_gather_matmul(stream, ordinal, x, w, nullptr, *out,
                           return_gathered ? &gathered_buffer : nullptr, channel, w_transposed);
}

ffi::Error AllGatherMatmulFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::AnyBuffer scale_x,
                                  ffi::AnyBuffer scale_w, ffi::Result<ffi::AnyBuffer> out,
                                  ffi_common::ChannelAttrs channel, int32_t scaling,
                                  int32_t library, bool fast_accum) {
  const Fp8Factors fp8{scale_x, scale_w, scaling, library, fast_accum};
  return all_gather_matmul(stream, ordinal, x, w, &fp8, *out, nullptr, channel,
                           /*w_transposed=*/true);
}

// The backward of matmul_reduce_scatter: dx = all_gather(dy) @ w^T and
// dw = x^T @ all_gather(dy), one all_gather_matmul sequence.
ffi::Error MatmulReduceScatterBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer dy,
                                      ffi::AnyBuffer w, ffi::AnyBuffer x,
                                      ffi::Result<ffi::AnyBuffer> dx,
                                      ffi::Result<ffi::AnyBuffer> dw,
                                      ffi_common::ChannelAttrs channel) {
  constexpr const char* kOp = "matmul_reduce_scatter (backward)";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(kOp, kOpMatmulReduceScatterBwd, stream, ordinal, dy, w, *dx, channel,
                             all_gather_matmul_region(channel, dy), &p);
      e.failure())
    return e;
  if (ffi::Error e = read_all_gather_matmul(kOp, dy, w, *dx, /*w_transposed=*/true, &p);
      e.failure())
    return e;
  if (ffi::Error e = read_weight_grad(kOp, x, *dw, dy, &p); e.failure()) return e;
  p.op = tp_matmul::Op::kAllGatherMatmul;
  return launched(kOp, tp_matmul::run(p));
}

// matmul_reduce_scatter's call (the forward, or with act/dw the backward of
// all_gather_matmul) after `prepare`: x [M, K], w, out [M / n, N].
ffi::Error read_matmul_reduce_scatter(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                      ffi::AnyBuffer out, bool w_transposed,
                                      tp_matmul::Params* p) {
  const auto xd = x.dimensions();
  int64_t wk = 0;
  if (xd.size() != 2 || !read_w(w, w_transposed, &wk, &p->n_cols, p) || xd[1] != wk ||
      xd[0] % p->n != 0)
    return ffi_common::invalid_argument(
        op, "expected x [M, K], w [K, N] (or [N, K] transposed), M divisible by the group");
  p->m = xd[0] / p->n;
  p->k = xd[1];
  if (out.size_bytes() != size_t(p->m) * p->n_cols * gemm::itemsize(p->out_type))
    return ffi_common::invalid_argument(op, "expected out [M / n, N]");
  return ffi::Error::Success();
}

// With peers, the region holds one partial shard per rank (tp_matmul.h).
size_t matmul_reduce_scatter_region(const ffi_common::ChannelAttrs& channel,
                                    ffi::AnyBuffer out) {
  return channel.group_size > 1 ? size_t(channel.group_size) * out.size_bytes() : 0;
}

// The forward (16-bit operands, or FP8 with their factors).
ffi::Error matmul_reduce_scatter(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                 ffi::AnyBuffer w, const Fp8Factors* fp8, ffi::AnyBuffer out,
                                 const ffi_common::ChannelAttrs& channel, bool w_transposed) {
  const char* op = fp8 ? "matmul_reduce_scatter (fp8)" : "matmul_reduce_scatter";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(op, kOpMatmulReduceScatter, stream, ordinal, x, w, out, channel,
                             matmul_reduce_scatter_region(channel, out), &p, fp8);
      e.failure())
    return e;
  if (ffi::Error e = read_matmul_reduce_scatter(op, x, w, out, w_transposed, &p); e.failure())
    return e;
  // one GEMM per chunk of m rows
  if (ffi::Error e = read_factors(op, fp8, int64_t(p.n) * p.m, p.n, &p); e.failure()) return e;
  p.op = tp_matmul::Op::kMatmulReduceScatter;
  return launched(op, tp_matmul::run(p));
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                   ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                   ffi_common::ChannelAttrs channel, bool w_transposed) {
  return matmul_reduce_scatter(stream, ordinal, x, w, nullptr, *out, channel, w_transposed);
}

ffi::Error MatmulReduceScatterFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                      ffi::AnyBuffer w, ffi::AnyBuffer scale_x,
                                      ffi::AnyBuffer scale_w, ffi::Result<ffi::AnyBuffer> out,
                                      ffi_common::ChannelAttrs channel, int32_t scaling,
                                      int32_t library, bool fast_accum) {
  const Fp8Factors fp8{scale_x, scale_w, scaling, library, fast_accum};
  return matmul_reduce_scatter(stream, ordinal, x, w, &fp8, *out, channel,
                               /*w_transposed=*/true);
}

// The backward of all_gather_matmul: dx = psum_scatter(dy @ w^T) and
// dw = gathered x^T @ dy, one matmul_reduce_scatter sequence.
ffi::Error AllGatherMatmulBwdImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer dy,
                                  ffi::AnyBuffer w, ffi::AnyBuffer gathered,
                                  ffi::Result<ffi::AnyBuffer> dx,
                                  ffi::Result<ffi::AnyBuffer> dw,
                                  ffi_common::ChannelAttrs channel) {
  constexpr const char* kOp = "all_gather_matmul (backward)";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(kOp, kOpAllGatherMatmulBwd, stream, ordinal, dy, w, *dx, channel,
                             matmul_reduce_scatter_region(channel, *dx), &p);
      e.failure())
    return e;
  if (ffi::Error e = read_matmul_reduce_scatter(kOp, dy, w, *dx, /*w_transposed=*/true, &p);
      e.failure())
    return e;
  if (ffi::Error e = read_weight_grad(kOp, gathered, *dw, dy, &p); e.failure()) return e;
  p.op = tp_matmul::Op::kMatmulReduceScatter;
  return launched(kOp, tp_matmul::run(p));
}

// 16-bit operands (w [K, N]), or FP8 with their factors (w [N, K]).
ffi::Error matmul_all_reduce(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::AnyBuffer w, const Fp8Factors* fp8, ffi::AnyBuffer out,
                             const ffi_common::ChannelAttrs& channel,
                             const ffi_common::ChannelAttrs& gather_channel, int32_t mechanism) {
  const char* kOp = fp8 ? "matmul_all_reduce (fp8)" : "matmul_all_reduce";
  if (!tp_matmul::is_all_reduce_mechanism(mechanism))
    return ffi_common::invalid_argument(kOp, "unknown mechanism id " + std::to_string(mechanism));
  const auto m = static_cast<tp_matmul::AllReduceMechanism>(mechanism);
  const bool one_shot = m == tp_matmul::AllReduceMechanism::kOneShot;
  // With peers: chunked, each region holds one reduced chunk per rank
  // ([M / n, N] each: out's bytes in all); one_shot, one partial [M, N] per
  // rank (tp_matmul.h).
  const size_t n = size_t(channel.group_size);
  const size_t needed = n > 1 ? (one_shot ? n : 1) * out.size_bytes() : 0;
  tp_matmul::Params p;
  if (ffi::Error e = prepare(kOp, kOpMatmulAllReduce, stream, ordinal, x, w, out, channel,
                             needed, &p, fp8);
      e.failure())
    return e;
  const auto xd = x.dimensions();
  int64_t wk = 0;
  if (xd.size() != 2 || !read_w(w, fp8 != nullptr, &wk, &p.n_cols, &p) || xd[1] != wk ||
      (!one_shot && xd[0] % p.n != 0))
    return ffi_common::invalid_argument(
        kOp, "expected x [M, K], w [K, N] ([N, K] FP8), M divisible by the group unless "
             "one_shot");
  if (out.size_bytes() != size_t(xd[0]) * p.n_cols * gemm::itemsize(p.out_type))
    return ffi_common::invalid_argument(kOp, "expected out [M, N]");
  p.op = tp_matmul::Op::kMatmulAllReduce;
  p.mechanism = m;
  p.m = one_shot ? xd[0] : xd[0] / p.n;
  p.k = xd[1];
  // chunked: one GEMM per chunk of m rows; one_shot: one of all rows
  if (ffi::Error e = read_factors(kOp, fp8, xd[0], one_shot ? 1 : p.n, &p); e.failure())
    return e;
  if (p.n > 1 && !one_shot) {  // the reduced chunks travel on their own channel
    ffi_common::GroupContext gather;
    if (ffi::Error e = ffi_common::make_group_context(kOp, kOpMatmulAllReduce, ordinal,
                                                      gather_channel, needed, &gather);
        e.failure())
      return e;
    if (gather.group.n != p.n || gather.group.rank != p.rank)
      return ffi_common::invalid_argument(kOp, "the two channels name different groups");
    for (int q = 0; q < p.n; ++q) p.gather_region[q] = gather.regions[q];
    p.gather_ch = gather.channel;
  }
  return launched(kOp, tp_matmul::run(p));
}

ffi::Error MatmulAllReduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                               ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                               ffi_common::ChannelAttrs channel,
                               ffi_common::ChannelAttrs gather_channel, int32_t mechanism) {
  return matmul_all_reduce(stream, ordinal, x, w, nullptr, *out, channel, gather_channel,
                           mechanism);
}

ffi::Error MatmulAllReduceFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::AnyBuffer scale_x,
                                  ffi::AnyBuffer scale_w, ffi::Result<ffi::AnyBuffer> out,
                                  ffi_common::ChannelAttrs channel, int32_t scaling,
                                  int32_t library, bool fast_accum,
                                  ffi_common::ChannelAttrs gather_channel, int32_t mechanism) {
  const Fp8Factors fp8{scale_x, scale_w, scaling, library, fast_accum};
  return matmul_all_reduce(stream, ordinal, x, w, &fp8, *out, channel, gather_channel,
                           mechanism);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulAllReduce, MatmulAllReduceImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                             // x: [M, K_local]
        .Arg<ffi::AnyBuffer>()                             // w: [K_local, N]
        .Ret<ffi::AnyBuffer>()                             // out: the sum [M, N]
        .Attr<ffi_common::ChannelAttrs>("channel")         // partial products
        .Attr<ffi_common::ChannelAttrs>("gather_channel")  // reduced chunks (chunked)
        .Attr<int32_t>("mechanism"),                       // tp_matmul::AllReduceMechanism
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherMatmul, AllGatherMatmulImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                      // x: this rank's rows [m, K]
        .Arg<ffi::AnyBuffer>()                      // w: [K, N] ([N, K] transposed)
        .Ret<ffi::AnyBuffer>()                      // out: [n*m, N]
        .Ret<ffi::AnyBuffer>()                      // gathered x [n*m, K] (or [0])
        .Attr<ffi_common::ChannelAttrs>("channel")  // group, slot, region, timeout
        .Attr<bool>("return_gathered")              // fill the second result
        .Attr<bool>("w_transposed"),                // w holds w^T
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherMatmulBwd, AllGatherMatmulBwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                       // dy: [n*m, N]
        .Arg<ffi::AnyBuffer>()                       // w: [K, N] (read as w^T)
        .Arg<ffi::AnyBuffer>()                       // the forward's gathered x [n*m, K]
        .Ret<ffi::AnyBuffer>()                       // dx: [m, K]
        .Ret<ffi::AnyBuffer>()                       // dw: [K, N]
        .Attr<ffi_common::ChannelAttrs>("channel"),  // matmul_reduce_scatter's
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulReduceScatterBwd, MatmulReduceScatterBwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                       // dy: our shard [m, N]
        .Arg<ffi::AnyBuffer>()                       // w: [K_local, N] (read as w^T)
        .Arg<ffi::AnyBuffer>()                       // the forward's x [n*m, K_local]
        .Ret<ffi::AnyBuffer>()                       // dx: [n*m, K_local]
        .Ret<ffi::AnyBuffer>()                       // dw: [K_local, N]
        .Attr<ffi_common::ChannelAttrs>("channel"),  // all_gather_matmul's
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulReduceScatter, MatmulReduceScatterImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()                      // x: [M, K_local]
        .Arg<ffi::AnyBuffer>()                      // w: [K_local, N] (or [N, K_local])
        .Ret<ffi::AnyBuffer>()                      // out: our shard [M/n, N]
        .Attr<ffi_common::ChannelAttrs>("channel")  // group, slot, region, timeout
        .Attr<bool>("w_transposed"),                // w holds w^T
    {ffi::Traits::kCmdBufferCompatible});

// The FP8 forwards: x and w FP8 (w [N, K], K-major) with their float32
// factors (read_factors: one each, or block factors); then the output and
// the ops' attributes.
namespace {
auto fp8_forward_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()   // x: [rows, K] FP8 (all_gather_matmul: this rank's rows)
      .Arg<ffi::AnyBuffer>()   // w^T: [N, K] FP8
      .Arg<ffi::AnyBuffer>()   // x's factors: [1], or per 1x128 in row groups
      .Arg<ffi::AnyBuffer>()   // w's factors: [1], or per 128x128 [K/128, N/128]
      .Ret<ffi::AnyBuffer>()   // out: as the 16-bit op's
      .Attr<ffi_common::ChannelAttrs>("channel")
      .Attr<int32_t>("scaling")   // gemm.h: Scaling (kTensor or kBlock)
      .Attr<int32_t>("library")   // gemm.h: Library
      .Attr<bool>("fast_accum");  // gemm::Problem::fast_accum
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherMatmulFp8, AllGatherMatmulFp8Impl, fp8_forward_binding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulReduceScatterFp8, MatmulReduceScatterFp8Impl,
                              fp8_forward_binding(), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulAllReduceFp8, MatmulAllReduceFp8Impl,
                              fp8_forward_binding()
                                  .Attr<ffi_common::ChannelAttrs>("gather_channel")
                                  .Attr<int32_t>("mechanism"),  // AllReduceMechanism
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
