// Dense GEMM on Hopper, row-major: D[m, n] = A[m, k] @ B[k, n] (+ C[m, n]),
// fp32 accumulation.
//
// The building block of the tensor-parallel ops: they run it on row chunks as
// the rows arrive (all_gather_matmul) or point D at a peer's memory so the
// epilogue's stores travel over NVLink, and add the peer's partial sums as C
// (matmul_reduce_scatter). The backward passes multiply by w^T: B may be
// given transposed, so no transposed copy of a weight is ever made; A may be
// given transposed for the weight gradients (dW = X^T @ dY reads X [k, m]
// row-major in place: the contraction runs over the rows of both operands).
//
// FP8 (A e4m3 or e5m2, B e4m3 or e5m2, not both e5m2): D = (A * sa) @ (B * sb)
// with the dequantization factors sa, sb of a Scaling recipe, fp32
// accumulation, bf16 or fp32 output. Hopper's FP8 wgmma reads both operands
// K-major only: A row-major [m, k], B given transposed ([n, k] row-major).
// An FP8 problem runs pk's CUTLASS kernels or cuBLASLt's (Library).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"

namespace pk::gemm {

using pk::DType;
using pk::is_fp8;
using pk::itemsize;

// How FP8 operands carry their scales (dequantization factors: the operand's
// value is its FP8 element times its factor).
//   kTensor: one fp32 factor per operand (sa[0], sb[0]). e4m3 x e4m3 runs
//     fast accumulation (the forward GEMMs' recipe); a product with an e5m2
//     gradient promotes the partial sums to fp32 every 4 wgmma K-steps,
//     unless Problem::fast_accum lets cuBLASLt skip the promotion.
//   kBlock: DeepSeek-V3's blocks: A per 1x128 (one row, 128 of K), stored
//     [ceil(k / 128), m] (M-contiguous, m a multiple of 4); B per 128x128
//     (128 of N by 128 of K), stored [ceil(k / 128), ceil(n / 128)], or with
//     b_row_blocks per 1x128 like A ([ceil(k / 128), n]: the weight
//     gradients' second activation operand); partial sums promoted to fp32
//     and scaled every 128 of K. e4m3 operands.
enum class Scaling : int32_t { kNone = 0, kTensor = 1, kBlock = 2 };

// Which code runs an FP8 problem: pk's CUTLASS kernels, or NVIDIA's
// cuBLASLt (cublaslt.h) where it is loaded and its heuristic takes the
// problem (else the CUTLASS kernel, the same numerics).
enum class Library : int32_t { kCutlass = 0, kCublasLt = 1 };

constexpr int kBlockK = 128;  // kBlock's K extent of a scale (and N's for B)

// kBlock's scales along an extent of K (or of N for B): ceil(extent / kBlockK).
constexpr int64_t scale_blocks(int64_t extent) { return (extent + kBlockK - 1) / kBlockK; }

struct Problem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k] row-major, or [k, m] row-major if a_transposed
  const void* b = nullptr;  // [k, n] row-major, or [n, k] row-major if b_transposed
  const void* c = nullptr;  // null, or [m, n] row-major of the output type: D = A @ B + C
  void* d = nullptr;        // [m, n] row-major, may live on a peer GPU
  bool b_transposed = false;
  bool a_transposed = false;  // only with B row-major and the output in the input type
  DType in = DType::kBF16;  // A, and B unless FP8
  DType out = DType::kBF16;
  // FP8 (in = e4m3 or e5m2): B's type, the recipe and the factors (above).
  DType in_b = DType::kE4M3;
  Scaling scaling = Scaling::kNone;
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  bool b_row_blocks = false;  // kBlock: B's factors per 1x128 instead of 128x128
  Library library = Library::kCutlass;  // FP8: who runs it (Library)
  // kTensor with an e5m2 operand: fast accumulation (the tensor cores' own
  // accumulator, no fp32 promotion; XLA's FP8 dots at default precision)
  // where cuBLASLt runs the product; the CUTLASS kernels promote regardless.
  bool fast_accum = false;
};

// Where the kernel runs and the scratch it may use (allocated at init).
struct Device {
  int ordinal = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// False when the extension was built without CUTLASS headers.
bool available();

// Inputs bf16 or f16; output the input type or f32 (the input type only when
// b_transposed or a_transposed; not both transposed); n and the row length of
// A (k, or m when a_transposed) multiples of 8 (16-byte rows for the TMA
// copies). FP8: b_transposed, A row-major, k a multiple of 16, n of 8, a
// scaling with both factors, bf16 or f32 output (fp32 only without C); kBlock:
// e4m3 operands and m a multiple of 4 (and n with b_row_blocks).
bool supported(const Problem& p);

// Load every instantiation on the current device (no lazy loading later),
// and cuBLASLt's handle for it where the library is loaded.
cudaError_t load_kernels();

// cuBLASLt's version (e.g. 130100) where it is loaded, else 0.
int cublaslt_version();

// Returns cudaErrorNotSupported for unsupported problems, cudaErrorInvalidValue
// when CUTLASS rejects the arguments or needs more scratch, or cuBLASLt's call
// fails (its CUDA error where it left one).
cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream);

// What run() would return for `p` short of launching: cudaSuccess when it
// would launch. Host sequences check every GEMM of a call before they
// enqueue anything.
cudaError_t check(const Problem& p, const Device& dev);

// The 16-bit GEMMs' tile configurations (gemm_sm90.cuh; tile_table.h picks
// one per problem):
//   kWide: 128x256x64 tiles, 2x1 clusters, cooperative (the two consumer
//     warpgroups share a tile): every layout;
//   kNarrow: 128x128x64 tiles, 2x1 clusters, ping-pong (each consumer
//     warpgroup its own tile, one's epilogue under the other's mainloop):
//     the forward layout with the output in the input type, for grids of
//     few wide tiles.
enum class Tiles : int32_t { kWide = 0, kNarrow = 1 };

// The instantiations (kernels/common/variants.h): one per (input type, output
// type, B layout, A layout, tiles), instantiations/gemm_<in>_<out>[_bt|_at|
// _narrow].cu; defined in gemm_sm90.cuh.
struct VariantKey {
  DType in, out;
  bool b_transposed;
  bool a_transposed = false;
  Tiles tiles = Tiles::kWide;
};
constexpr bool operator==(const VariantKey& a, const VariantKey& b) {
  return a.in == b.in && a.out == b.out && a.b_transposed == b.b_transposed &&
         a.a_transposed == b.a_transposed && a.tiles == b.tiles;
}
template <DType kIn, DType kOut, bool kBTransposed, bool kATransposed = false,
          Tiles kTiles = Tiles::kWide>
struct Variant {
  static constexpr VariantKey key{kIn, kOut, kBTransposed, kATransposed, kTiles};
  static cudaError_t check(const Problem& p, const Device& dev);
  static cudaError_t launch(const Problem& p, const Device& dev, cudaStream_t stream);
  static cudaError_t load();
};

// The FP8 instantiations: one per (A type, B type, output type, scaling, B's
// block shape), gemm_fp8_*.cu; defined in gemm_fp8_sm90.cuh.
struct Fp8Key {
  DType a, b, out;
  Scaling scaling;
  bool b_row_blocks = false;
};
constexpr bool operator==(const Fp8Key& x, const Fp8Key& y) {
  return x.a == y.a && x.b == y.b && x.out == y.out && x.scaling == y.scaling &&
         x.b_row_blocks == y.b_row_blocks;
}
template <DType kA, DType kB, DType kOut, Scaling kScaling, bool kBRowBlocks = false>
struct Fp8Variant {
  static constexpr Fp8Key key{kA, kB, kOut, kScaling, kBRowBlocks};
  static cudaError_t check(const Problem& p, const Device& dev);
  static cudaError_t launch(const Problem& p, const Device& dev, cudaStream_t stream);
  static cudaError_t load();
};

}  // namespace pk::gemm
