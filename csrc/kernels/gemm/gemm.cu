// Host side of the GEMM: checks and the dispatch to the instantiations.
#include "kernels/gemm/gemm.h"

#include "kernels/common/variants.h"
#include "kernels/gemm/cublaslt.h"
#include "kernels/gemm/tile_table.h"

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
                       Variant<DType::kF16, DType::kF16, false, true>,
                       Variant<DType::kBF16, DType::kBF16, false, false, Tiles::kNarrow>,
                       Variant<DType::kF16, DType::kF16, false, false, Tiles::kNarrow>>;

using Fp8Instantiations = variants::Built<
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kBF16, Scaling::kTensor>,
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kF32, Scaling::kTensor>,
    Fp8Variant<DType::kE5M2, DType::kE4M3, DType::kBF16, Scaling::kTensor>,
    Fp8Variant<DType::kE5M2, DType::kE4M3, DType::kF32, Scaling::kTensor>,
    Fp8Variant<DType::kE4M3, DType::kE5M2, DType::kBF16, Scaling::kTensor>,
    Fp8Variant<DType::kE4M3, DType::kE5M2, DType::kF32, Scaling::kTensor>,
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kBF16, Scaling::kBlock>,
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kF32, Scaling::kBlock>,
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kBF16, Scaling::kBlock, true>,
    Fp8Variant<DType::kE4M3, DType::kE4M3, DType::kF32, Scaling::kBlock, true>>;

}  // namespace

cudaError_t load_kernels() {
  if (cudaError_t err = Instantiations::load(); err != cudaSuccess) return err;
  if (cudaError_t err = Fp8Instantiations::load(); err != cudaSuccess) return err;
  return cublaslt::load();
}

int cublaslt_version() { return cublaslt::version(); }

bool available() { return variants::kHaveCutlass; }

namespace {
bool fp8_supported(const Problem& p) {
  const bool types = is_fp8(p.in) && is_fp8(p.in_b) &&
                     !(p.in == DType::kE5M2 && p.in_b == DType::kE5M2) &&
                     (p.out == DType::kBF16 || p.out == DType::kF32);
  const bool layout = p.b_transposed && !p.a_transposed;
  const bool scales = p.scale_a != nullptr && p.scale_b != nullptr;
  const bool library = p.library == Library::kCutlass || p.library == Library::kCublasLt;
  bool recipe = false;
  if (p.scaling == Scaling::kTensor) {
    recipe = !p.b_row_blocks;
  } else if (p.scaling == Scaling::kBlock) {
    recipe = p.in == DType::kE4M3 && p.in_b == DType::kE4M3 && p.m % 4 == 0 &&
             (!p.b_row_blocks || p.n % 4 == 0);
  }
  const int64_t limit = int64_t(1) << 31;
  return types && layout && scales && library && recipe && p.m > 0 && p.n > 0 && p.k > 0 &&
         p.k % 16 == 0 && p.n % 8 == 0 && p.m < limit && p.n < limit && p.k < limit;
}
}  // namespace

bool supported(const Problem& p) {
  if (is_fp8(p.in)) return fp8_supported(p);
  if (p.scaling != Scaling::kNone) return false;
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
  return VariantKey{p.in, p.out, p.b_transposed, p.a_transposed, tiles_for(p)};
}
}  // namespace

namespace {
Fp8Key fp8_key_of(const Problem& p) {
  return Fp8Key{p.in, p.in_b, p.out, p.scaling, p.b_row_blocks};
}

// An FP8 problem cuBLASLt was asked for and takes (Library).
bool library_runs(const Problem& p, const Device& dev) {
  return p.library == Library::kCublasLt && cublaslt::takes(p, dev);
}
}  // namespace

cudaError_t check(const Problem& p, const Device& dev) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
  if (is_fp8(p.in) && library_runs(p, dev)) return cudaSuccess;
  if (is_fp8(p.in)) return Fp8Instantiations::check(fp8_key_of(p), p, dev);
  return Instantiations::check(key_of(p), p, dev);
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  if (!available() || !supported(p)) return cudaErrorNotSupported;
  if (is_fp8(p.in) && p.library == Library::kCublasLt) {  // one heuristic lookup
    if (cudaError_t err = cublaslt::run(p, dev, stream); err != cudaErrorNotSupported) return err;
  }
  if (is_fp8(p.in)) return Fp8Instantiations::launch(fp8_key_of(p), p, dev, stream);
  return Instantiations::launch(key_of(p), p, dev, stream);
}

}  // namespace pk::gemm
