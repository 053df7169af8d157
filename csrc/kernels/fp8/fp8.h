// FP8 quantization for the FP8 GEMMs (kernels/gemm: Scaling): a 16- or
// 32-bit matrix x [rows, cols] to e4m3 or e5m2 with its dequantization
// factors (x ~= q * factor), as the GEMMs read them.
//
// Recipes (Granularity):
//   kTensor: one factor for the whole matrix, fp8_max / amax(x) as the scale
//     (Transformer Engine's current scaling), or a scale given in device
//     memory (delayed scaling: the caller's amax history chose it); the call
//     also returns amax(x) for the history.
//   kRows: one factor per 1x128 along the columns of each row (DeepSeek-V3's
//     activations): factors [ceil(cols / 128), rows] (row-contiguous: the
//     GEMM's A factors when the columns are the contraction). With
//     row_groups = g > 1 the rows form g groups of rows / g consecutive rows,
//     each group's factors [ceil(cols / 128), rows / g] contiguous, the
//     groups back to back ([g * ceil(cols / 128), rows / g]): the A factors
//     of a GEMM on one group (the TP host sequences' row chunks).
//   kCols: one factor per 128x1 along the rows of each column, written with
//     the transposed output only (the weight gradient reads x^T with its
//     contraction, the rows, contiguous): factors [ceil(rows / 128), cols].
//   kBlocks: one factor per 128x128 block (the weights): [ceil(rows / 128),
//     ceil(cols / 128)].
//   kRowsCols: both copies of an activation in one pass over x: q per 1x128
//     (kRows' factors, row groups included, in `factors`) and qt per 128x1
//     (kCols' factors in `factors_t`).
//   kRowsBlocks: q per 1x128 (kRows' factors in `factors`) and qt per
//     128x128 (kBlocks' factors in `factors_t`) in one pass.
// Outputs: q [rows, cols] (row-wise copy) and/or qt [cols, rows] (the
// transposed copy the backward GEMMs read: FP8 wgmma takes K-major operands
// only); each is optional (null) but one must be asked for (kRows: q only;
// kCols: qt only; kRowsCols, kRowsBlocks: both).
// A factor of a block whose amax is 0 is 1; every value is scaled in fp32
// and converted with saturation to the format's largest finite value.
// NaN/Inf in a block make its factor non-finite (they propagate).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"

namespace pk::fp8 {

enum class Granularity : int32_t {
  kTensor = 0, kRows = 1, kCols = 2, kBlocks = 3, kRowsCols = 4, kRowsBlocks = 5
};

// Whether a granularity gives q per 1x128 (with row groups), and whether it
// writes qt's factors to Quantize::factors_t.
__host__ __device__ constexpr bool row_factors(Granularity g) {
  return g == Granularity::kRows || g == Granularity::kRowsCols || g == Granularity::kRowsBlocks;
}
__host__ __device__ constexpr bool two_factors(Granularity g) {
  return g == Granularity::kRowsCols || g == Granularity::kRowsBlocks;
}

constexpr int kBlock = 128;  // the block extent of kRows / kCols / kBlocks

// Largest finite value of an FP8 format.
inline float max_finite(DType t) { return t == DType::kE4M3 ? 448.0f : 57344.0f; }

struct Quantize {
  const void* x = nullptr;      // [rows, cols] of `in`
  int64_t rows = 0, cols = 0;
  DType in = DType::kBF16;      // bf16, f16 or f32
  DType out = DType::kE4M3;     // e4m3 or e5m2
  Granularity granularity = Granularity::kTensor;
  void* q = nullptr;            // [rows, cols] of `out`, or null
  void* qt = nullptr;           // [cols, rows] of `out`, or null
  float* factors = nullptr;     // the dequantization factors (layouts above)
  float* factors_t = nullptr;   // kRowsCols, kRowsBlocks: qt's factors; else null
  int64_t row_groups = 1;       // row_factors(): the row groups of q's factors; else 1
  // kTensor: the scale to use (delayed scaling), or null to derive it from
  // this matrix's amax (current scaling); amax receives amax(x) either way.
  const float* scale = nullptr;
  float* amax = nullptr;        // kTensor: [1], required
  float margin = 0.0f;          // scale = max_finite * 2^-margin / amax (kTensor, current)
  cudaStream_t stream = nullptr;  // every kernel of the call
};

// What run() would refuse, without launching.
cudaError_t check(const Quantize& p);
// Every kernel of the call on p.stream (kTensor without a scale: an amax
// reduction, then the conversion).
cudaError_t run(const Quantize& p);
// Load the kernels on the current device (no lazy loading later).
cudaError_t load_kernels();

}  // namespace pk::fp8
