// Host side of the GEMM: checks and the dispatch to the instantiations.
#include "kernels/gemm/gemm.h"

#include "kernels/common/variants.h"

namespace pk::gemm {
namespace {

using Instantiations =
    variants::Built<Variant<DType::kBF16, DType::kBF16, false>,
                       Variant<DType::kBF16, DType::kF32, false>,
                       Variant<DType::kF16, DType::kF16, false>,
                       Variant<DType::kF16, DType::kF32, false>,
                       Variant<DType::kBF16, DType::kBF16, true>,
                       Variant<DType::kF16, DType::kF16, true>,
                       Variant<DType::kBF16, DType::kBF16, false, true>,
                       Variant<DType::kF16, DType::kF16, false, true>>;

}  // namespace

cudaError_t load_kernels() { return Instantiations::load(); }

bool available() { return variants::kHaveCutlass; }

bool supported(const Problem& p) {
  const bool types =
      (p.in == DType::kBF16 || p.in == DType::kF16) &&
      (p.out == p.in || (p.out == DType::kF32 && !p.b_transposed && !p.a_transposed)) &&
      !(p.a_transposed && p.b_transposed);
  const int64_t limit = int64_t(1) << 31;
  const int64_t a_row = p.a_transposed ? p.m : p.k;  // A's contiguous extent
  return types && p.m > 0 && p.n > 0 && p.k > 0 && p.n % 8 == 0 && a_row % 8 == 0 &&
         p.m < limit && p.n < limit && p.k < limit;
}

namespace {
VariantKey key_of(const Problem& p) {
  return VariantKey{p.in, p.out, p.b_transposed, p.a_transposed};
}
}  // namespace

cudaError_t check(const Problem& p, const Device& dev) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
  return Instantiations::check(key_of(p), p, dev);
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
  return Instantiations::launch(key_of(p), p, dev, stream);
}

}  // namespace pk::gemm
