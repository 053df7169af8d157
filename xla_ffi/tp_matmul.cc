// FFI handlers for pk_jax.all_gather_matmul and pk_jax.matmul_reduce_scatter.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "kernels/tp_matmul/tp_matmul.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_common.h"
#include "xla_ffi/handlers.h"

namespace pk::ffi_handlers {
namespace {

namespace ffi = xla::ffi;

bool to_gemm_type(ffi::DataType t, gemm::DType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = gemm::DType::kBF16; return true;
    case ffi::DataType::F16: *out = gemm::DType::kF16; return true;
    case ffi::DataType::F32: *out = gemm::DType::kF32; return true;
    default: return false;
  }
}

// Everything both ops share: the group, the channel, its region, the streams.
ffi::Error prepare(const char* op, int32_t op_id, cudaStream_t stream, int32_t ordinal,
                   ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer out,
                   ffi::Span<const int64_t> group_ids, int64_t group_size, int64_t slot,
                   int64_t data_offset, int64_t timeout_ns, int32_t skip_post_rank,
                   tp_matmul::Params* p) {
  ffi_common::GroupContext ctx;
  if (ffi::Error e = ffi_common::make_group_context(op, op_id, ordinal, group_ids, group_size,
                                                    timeout_ns, &ctx);
      e.failure())
    return e;
  if (!gemm::available()) return ffi_common::built_without_cutlass(op);
  if (slot < 0 || slot >= kMaxSlots || data_offset < 0)
    return ffi_common::invalid_argument(op, "bad channel");
  if (!to_gemm_type(x.element_type(), &p->in) || x.element_type() != w.element_type() ||
      !to_gemm_type(out.element_type(), &p->out_type))
    return ffi_common::invalid_argument(op, "unsupported dtypes");
  const ffi_common::Group& g = ctx.group;
  const runtime::DeviceState& d = *g.self;
  p->rank = g.rank;
  p->n = g.n;
  for (int q = 0; q < g.n; ++q) p->region[q] = ctx.workspaces[q] + kDataOffset + data_offset;
  p->ch = ctx.channel(int(slot));
  p->region_bytes = runtime::Runtime::get().data_bytes() - size_t(data_offset);
  p->skip_post = skip_post_rank == g.rank;
  p->gemm_dev = {d.ordinal, d.sm_count, d.gemm_workspace, d.gemm_workspace_bytes};
  p->stream = stream;
  p->side_stream = d.side_stream;
  p->fork = d.fork;
  p->join = d.join;
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

ffi::Error check_region(const char* op, size_t needed, const tp_matmul::Params& p) {
  return ffi_common::check_region_fits(op, needed, p.region_bytes);
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

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                               ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> gathered,
                               ffi::Span<const int64_t> group_ids, int64_t group_size,
                               int64_t slot, int64_t data_offset, int64_t timeout_ns,
                               int32_t skip_post_rank, bool return_gathered,
                               bool w_transposed) {
  constexpr const char* kOp = "all_gather_matmul";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(kOp, kOpAllGatherMatmul, stream, ordinal, x, w, *out, group_ids,
                             group_size, slot, data_offset, timeout_ns, skip_post_rank, &p);
      e.failure())
    return e;
  const auto xd = x.dimensions();
  int64_t wk = 0;
  if (xd.size() != 2 || !read_w(w, w_transposed, &wk, &p.n_cols, &p) || xd[1] != wk)
    return ffi_common::invalid_argument(kOp, "expected x [m, K], w [K, N] (or [N, K] transposed)");
  p.m = xd[0];
  p.k = xd[1];
  p.gathered = return_gathered ? gathered->untyped_data() : nullptr;
  if (p.n > 1)
    if (ffi::Error e = check_region(kOp, tp_matmul::ag_matmul_region_bytes(p.n, p.m, p.k, p.in), p);
        e.failure())
      return e;
  return launched(kOp, tp_matmul::all_gather_matmul(p));
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                   ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Span<const int64_t> group_ids, int64_t group_size,
                                   int64_t slot, int64_t data_offset, int64_t timeout_ns,
                                   int32_t skip_post_rank, bool w_transposed, bool fused) {
  constexpr const char* kOp = "matmul_reduce_scatter";
  tp_matmul::Params p;
  if (ffi::Error e = prepare(kOp, kOpMatmulReduceScatter, stream, ordinal, x, w, *out,
                             group_ids, group_size, slot, data_offset, timeout_ns,
                             skip_post_rank, &p);
      e.failure())
    return e;
  const auto xd = x.dimensions();
  int64_t wk = 0;
  if (xd.size() != 2 || !read_w(w, w_transposed, &wk, &p.n_cols, &p) || xd[1] != wk ||
      xd[0] % p.n != 0)
    return ffi_common::invalid_argument(
        kOp, "expected x [M, K], w [K, N] (or [N, K] transposed), M divisible by the group");
  p.m = xd[0] / p.n;
  p.k = xd[1];
  p.fused = fused && p.n > 1;
  if (p.fused && !tp_matmul::fused_rs_supported(p))
    return ffi_common::invalid_argument(
        kOp, "fused: needs an output of the input type (bf16/fp16) and shard rows a "
             "multiple of 128");
  const size_t region =
      p.fused ? tp_matmul::fused_rs_region_bytes(p.n, p.m, p.n_cols, p.out_type)
              : tp_matmul::matmul_rs_region_bytes(p.n, p.m, p.n_cols, p.out_type);
  if (p.n > 1)
    if (ffi::Error e = check_region(kOp, region, p); e.failure()) return e;
  return launched(kOp, tp_matmul::matmul_reduce_scatter(p));
}

// The attributes both handlers take after their buffers (the channel, its
// region and the waits' bound), in their Impl functions' order.
template <typename Binding>
auto with_channel_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int64_t>>("group_ids")  // device ids, group by group
      .template Attr<int64_t>("group_size")                  // ranks per group
      .template Attr<int64_t>("slot")                        // workspace channel
      .template Attr<int64_t>("data_offset")                 // channel's data region
      .template Attr<int64_t>("timeout_ns")                  // bound of every wait
      .template Attr<int32_t>("skip_post_rank");             // testing: -1 normally
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherMatmul, AllGatherMatmulImpl,
    with_channel_attrs(ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()   // x: this rank's rows [m, K]
                           .Arg<ffi::AnyBuffer>()   // w: [K, N] ([N, K] transposed)
                           .Ret<ffi::AnyBuffer>()   // out: [n*m, N]
                           .Ret<ffi::AnyBuffer>())  // gathered x [n*m, K] (or [0])
        .Attr<bool>("return_gathered")                  // fill the second result
        .Attr<bool>("w_transposed"),                    // w holds w^T
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulReduceScatter, MatmulReduceScatterImpl,
    with_channel_attrs(ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()   // x: [M, K_local]
                           .Arg<ffi::AnyBuffer>()   // w: [K_local, N] (or [N, K_local])
                           .Ret<ffi::AnyBuffer>())  // out: our shard [M/n, N]
        .Attr<bool>("w_transposed")                     // w holds w^T
        .Attr<bool>("fused"),                           // one GEMM, scattering epilogue
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace pk::ffi_handlers
