// Host side of the grouped GEMM: checks and the dispatch to the instantiations.
#include "kernels/grouped_matmul/grouped_matmul.h"

#include "kernels/common/variants.h"

namespace pk::grouped_matmul {
namespace {

using Instantiations = variants::Built<
    Variant<DType::kBF16, Kind::kForward>, Variant<DType::kBF16, Kind::kForward, true>,
    Variant<DType::kBF16, Kind::kLhsGrad>, Variant<DType::kBF16, Kind::kRhsGrad>,
    Variant<DType::kF16, Kind::kForward>, Variant<DType::kF16, Kind::kForward, true>,
    Variant<DType::kF16, Kind::kLhsGrad>, Variant<DType::kF16, Kind::kRhsGrad>>;

}  // namespace

bool available() { return variants::kHaveCutlass; }

bool supported(const Params& p) {
  const int64_t limit = int64_t(1) << 31;
  return (p.type == DType::kBF16 || p.type == DType::kF16) && p.groups >= 1 &&
         p.groups <= kMaxGroups && p.rows >= 0 && p.k > 0 && p.n > 0 && p.k % 8 == 0 &&
         p.n % 8 == 0 && p.rows < limit && p.k < limit && p.n < limit && p.k * p.n < limit &&
         p.scratch_bytes >= scratch_bytes(p.groups) &&
         (!p.f32_out || p.kind == Kind::kForward);
}

cudaError_t load_kernels() { return Instantiations::load(); }

cudaError_t run(const Params& p) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
  return Instantiations::launch(VariantKey{p.type, p.kind, p.f32_out}, p);
}

}  // namespace pk::grouped_matmul
