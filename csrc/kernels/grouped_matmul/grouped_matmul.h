// Grouped GEMM over ragged row groups (pk_jax.grouped_matmul, the MoE
// experts' GEMM): jax.lax.ragged_dot's forward and both of its gradients.
//
// Rows are grouped consecutively: group g holds rows [o_g, o_g + r_g) with
// o_g the sum of the sizes before it; the sizes live on the device (group
// sizes come from routing), so no host ever reads them. A negative size
// counts as 0 and a group reaching past row M is cut at M.
//   kForward: out[o_g + i, :] = a[o_g + i, :K] @ b[g]  (a [M, K], b [G, K, N],
//             out [M, N]; rows past the groups' sum are zeros)
//   kLhsGrad: out[o_g + i, :] = a[o_g + i, :N] @ b[g]^T  (a = dout [M, N],
//             b = rhs [G, K, N] read transposed in place, out [M, K]; rows
//             past the sum are zeros)
//   kRhsGrad: out[g] = a[o_g : o_g + r_g]^T @ b[o_g : o_g + r_g]  (a = lhs
//             [M, K] read transposed in place, b = dout [M, N], out [G, K, N];
//             an empty group's out[g] is zeros)
// Every operand has one type, bf16 or fp16, and so has the result, or fp32
// for kForward (f32_out); fp32 accumulation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"

namespace pk::grouped_matmul {

using pk::DType;

enum class Kind : int32_t { kForward = 0, kLhsGrad = 1, kRhsGrad = 2 };

struct Params {
  Kind kind = Kind::kForward;
  DType type = DType::kBF16;            // the operands
  bool f32_out = false;                 // kForward only: the result in fp32
  int64_t rows = 0;                     // M
  int64_t k = 0, n = 0;                 // the rhs' [K, N] per group
  int32_t groups = 0;                   // G
  const int32_t* group_sizes = nullptr;  // [G], device
  const void* a = nullptr;              // see the kinds above
  const void* b = nullptr;
  void* out = nullptr;
  void* scratch = nullptr;              // scratch_bytes(groups) of device memory
  size_t scratch_bytes = 0;
  int sm_count = 0;
  int ordinal = 0;
  cudaStream_t stream = nullptr;
};

// Scratch a call needs: the per-group arrays the setup kernel writes and the
// grouped kernel's own workspace (per-SM tensor maps; checked at launch).
inline constexpr int kMaxGroups = 2048;  // the setup's shared memory: 16 bytes per group
inline constexpr size_t kPerGroupScratch = 256;
inline constexpr size_t kKernelScratch = 1 << 20;
inline size_t scratch_bytes(int64_t groups) {
  return size_t(groups) * kPerGroupScratch + kKernelScratch;
}

// False when the extension was built without CUTLASS headers.
bool available();

// bf16 or fp16; K and N multiples of 8 (16-byte rows for the TMA copies);
// 1 <= G <= kMaxGroups; M, K, N and each group's K * N elements below 2^31.
bool supported(const Params& p);

cudaError_t load_kernels();

// Zeros where no group writes, the setup kernel, the grouped GEMM: all on
// p.stream. cudaErrorNotSupported for unsupported problems.
cudaError_t run(const Params& p);

// The instantiations, one per (type, kind, output type):
// instantiations/grouped_<type>_<kind>[_f32].cu.
struct VariantKey {
  DType type;
  Kind kind;
  bool f32_out;
};
constexpr bool operator==(const VariantKey& x, const VariantKey& y) {
  return x.type == y.type && x.kind == y.kind && x.f32_out == y.f32_out;
}
template <DType kType, Kind kKind, bool kF32Out = false>
struct Variant {
  static constexpr VariantKey key{kType, kKind, kF32Out};
  static cudaError_t check(const Params& p);
  static cudaError_t launch(const Params& p);
  static cudaError_t load();
};

}  // namespace pk::grouped_matmul
