// tools/quantize_bench: the FP8 quantization kernels (csrc/kernels/fp8) on one
// GPU: every output checked bit for bit against a naive reference (a thread per
// factor for the amaxes, a thread per element for the bytes), then timed, as
// bandwidth (bytes read + written over time) beside a device-to-device copy
// of the same bytes in the same run.
// Usage: quantize_bench [R,C ...] (bf16 input; default: LLM activation and
// gradient sizes and a few shapes off the tiles).
// Build: nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -I.
//   tools/quantize_bench/main.cu csrc/kernels/fp8/quantize.cu -o quantize_bench
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8/fp8.h"
#include "tools/sweep_common.cuh"

namespace {

using pk::fp8::Granularity;
using pk_sweep::check;
using pk_sweep::free_all;

constexpr int kB = pk::fp8::kBlock;

// The naive reference. amax of factor f's block (its layout per granularity).
__global__ void ref_amax(const __nv_bfloat16* x, int64_t rows, int64_t cols, Granularity g,
                         float* amax, int64_t count) {
  const int64_t f = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (f >= count) return;
  int64_t r0 = 0, r1 = rows, c0 = 0, c1 = cols;
  const int64_t tc = (cols + kB - 1) / kB;
  if (g == Granularity::kRows) { r0 = f % rows; r1 = r0 + 1; c0 = (f / rows) * kB; c1 = c0 + kB; }
  if (g == Granularity::kCols) { c0 = f % cols; c1 = c0 + 1; r0 = (f / cols) * kB; r1 = r0 + kB; }
  if (g == Granularity::kBlocks) { r0 = (f / tc) * kB; r1 = r0 + kB; c0 = (f % tc) * kB; c1 = c0 + kB; }
  float m = 0.f;
  for (int64_t r = r0; r < (r1 < rows ? r1 : rows); ++r)
    for (int64_t c = c0; c < (c1 < cols ? c1 : cols); ++c)
      m = fmaxf(m, fabsf(__bfloat162float(x[r * cols + c])));
  amax[f] = m;
}

// kTensor: the scale given (host-computed); else from the block's amax.
__global__ void ref_amax_all(const __nv_bfloat16* x, int64_t count, float* amax) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));  // m >= 0: int order
}

__device__ float ref_scale(const float* amax, int64_t r, int64_t c, int64_t rows, int64_t cols,
                           Granularity g, float fp8_max) {
  const int64_t tc = (cols + kB - 1) / kB;
  if (g == Granularity::kTensor) return amax[0];
  const float a = g == Granularity::kRows ? amax[(c / kB) * rows + r]
                  : g == Granularity::kCols ? amax[(r / kB) * cols + c]
                                            : amax[(r / kB) * tc + c / kB];
  return a == 0.f ? 1.f : fp8_max / a;
}

// The bytes q [r, c] and qt [c, r] must hold (e4m3: fmt 0, e5m2: 1).
__global__ void ref_bytes(const __nv_bfloat16* x, int64_t rows, int64_t cols, Granularity g,
                          const float* amax, int fmt, uint8_t* q, uint8_t* qt) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  const float fp8_max = fmt == 0 ? 448.f : 57344.f;
  const float v = __bfloat162float(x[i]) * ref_scale(amax, r, c, rows, cols, g, fp8_max);
  const uint8_t b = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt == 0 ? __NV_E4M3 : __NV_E5M2);
  if (q) q[i] = b;
  if (qt) qt[c * rows + r] = b;
}

__global__ void ref_factors(const float* amax, int64_t count, float fp8_max, bool tensor,
                            float* out) {
  const int64_t f = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (f < count) out[f] = 1.f / (tensor ? amax[0] : amax[f] == 0.f ? 1.f : fp8_max / amax[f]);
}

bool same(const void* a, const void* b, size_t bytes) {
  std::vector<uint8_t> x(bytes), y(bytes);
  check(cudaMemcpy(x.data(), a, bytes, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(y.data(), b, bytes, cudaMemcpyDeviceToHost), "copy");
  return std::memcmp(x.data(), y.data(), bytes) == 0;
}

struct Case {
  const char* name;
  Granularity g;
  bool rowwise, transposed, given_scale;
  int fmt;
};

// The granularity of each copy's factors: (q's, qt's); the two-factor ones
// (fp8.h: kRowsCols, kRowsBlocks) quantize qt as kCols / kBlocks would.
std::pair<Granularity, Granularity> copies_of(Granularity g) {
  if (g == Granularity::kRowsCols) return {Granularity::kRows, Granularity::kCols};
  if (g == Granularity::kRowsBlocks) return {Granularity::kRows, Granularity::kBlocks};
  return {g, g};
}

// The factors of a (one-layout) granularity.
int64_t factor_count(Granularity g, int64_t rows, int64_t cols) {
  const int64_t tr = (rows + kB - 1) / kB, tc = (cols + kB - 1) / kB;
  return g == Granularity::kTensor ? 1 : g == Granularity::kRows ? tc * rows
         : g == Granularity::kCols ? tr * cols : tr * tc;
}
constexpr Case kCases[] = {
    {"tensor current, both copies, e4m3", Granularity::kTensor, true, true, false, 0},
    {"tensor delayed, both copies, e4m3", Granularity::kTensor, true, true, true, 0},
    {"tensor delayed, both copies, e5m2", Granularity::kTensor, true, true, true, 1},
    {"tensor current, row-wise, e4m3", Granularity::kTensor, true, false, false, 0},
    {"rows (1x128), e4m3", Granularity::kRows, true, false, false, 0},
    {"cols (128x1), transposed, e4m3", Granularity::kCols, false, true, false, 0},
    {"blocks (128x128), both copies, e4m3", Granularity::kBlocks, true, true, false, 0},
    {"rows (1x128) + cols (128x1), one pass, e4m3", Granularity::kRowsCols, true, true, false, 0},
    {"rows (1x128) + blocks (128x128), one pass, e4m3", Granularity::kRowsBlocks, true, true,
     false, 0},
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int i = 1; i < argc; ++i) {
    long long r = 0, c = 0;
    if (std::sscanf(argv[i], "%lld,%lld", &r, &c) != 2) return std::fprintf(stderr, "bad %s\n", argv[i]), 2;
    shapes.push_back({r, c});
  }
  if (shapes.empty())
    shapes = {{8192, 5120}, {8192, 13824}, {16384, 8192}, {8192, 4096}, {4096, 14336},
              {1000, 520}, {272, 136}};
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("%s, %d SMs\n| R x C | case | ms | GB/s | of copy | check |\n| --- | --- | --- | --- | --- | --- |\n",
              prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  check(cudaStreamCreate(&s), "stream");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  const uint32_t seed = uint32_t(std::random_device{}());
  bool all_ok = true;
  for (auto [rows, cols] : shapes) {
    const size_t n = size_t(rows) * cols;
    __nv_bfloat16* x;
    uint8_t *q, *qt, *rq, *rqt, *copy;
    float *factors, *rfactors, *factors_t, *rfactors_t, *amax, *ramax, *scale;
    const size_t nf = std::max<size_t>(size_t((rows + kB - 1) / kB) * cols,
                                       size_t((cols + kB - 1) / kB) * rows);
    check(cudaMalloc(&x, n * 2), "x");
    check(cudaMalloc(&q, n), "q");
    check(cudaMalloc(&qt, n), "qt");
    check(cudaMalloc(&rq, n), "rq");
    check(cudaMalloc(&rqt, n), "rqt");
    check(cudaMalloc(&copy, 2 * n * 2), "copy");
    check(cudaMalloc(&factors, nf * 4), "factors");
    check(cudaMalloc(&rfactors, nf * 4), "rfactors");
    check(cudaMalloc(&factors_t, nf * 4), "factors_t");
    check(cudaMalloc(&rfactors_t, nf * 4), "rfactors_t");
    check(cudaMalloc(&amax, 4), "amax");
    check(cudaMalloc(&ramax, nf * 4), "ramax");
    check(cudaMalloc(&scale, 4), "scale");
    pk_sweep::fill<<<1024, 256, 0, s>>>(x, n, seed ^ uint32_t(rows * 31 + cols), 3.0f);
    // The copy ceiling: read and write the bf16 input once (2n + 2n bytes).
    float copy_ms = 0.f;
    for (int rep = 0; rep < 2; ++rep) {
      check(cudaEventRecord(e0, s), "record");
      for (int i = 0; i < 20; ++i)
        check(cudaMemcpyAsync(copy + (i % 2) * n * 2, x, n * 2, cudaMemcpyDeviceToDevice, s), "copy");
      check(cudaEventRecord(e1, s), "record");
      check(cudaEventSynchronize(e1), "sync");
      check(cudaEventElapsedTime(&copy_ms, e0, e1), "elapsed");
    }
    copy_ms /= 20;
    const double copy_gbs = 4.0 * n / (copy_ms * 1e-3) / 1e9;
    std::printf("| %lldx%lld | device-to-device copy of x | %.4f | %.0f | 1.00 | |\n",
                (long long)rows, (long long)cols, copy_ms, copy_gbs);
    for (const Case& c : kCases) {
      pk::fp8::Quantize p;
      p.x = x; p.rows = rows; p.cols = cols; p.in = pk::DType::kBF16;
      p.out = c.fmt == 0 ? pk::DType::kE4M3 : pk::DType::kE5M2;
      p.granularity = c.g;
      p.q = c.rowwise ? q : nullptr;
      p.qt = c.transposed ? qt : nullptr;
      p.factors = factors;
      const auto [gq, gt] = copies_of(c.g);
      const bool two = gq != gt;
      p.factors_t = two ? factors_t : nullptr;
      p.amax = amax;
      p.stream = s;
      const int64_t count = factor_count(gq, rows, cols);
      const int64_t count_t = two ? factor_count(gt, rows, cols) : 0;
      // Reference: the amaxes, then the scale (delayed: fp8_max / (amax * 1.5)).
      const float fp8_max = c.fmt == 0 ? 448.f : 57344.f;
      if (c.g == Granularity::kTensor) {
        check(cudaMemsetAsync(ramax, 0, 4, s), "ramax");
        ref_amax_all<<<1024, 256, 0, s>>>(x, int64_t(n), ramax);
      } else {
        ref_amax<<<int((count + 127) / 128), 128, 0, s>>>(x, rows, cols, gq, ramax, count);
      }
      float host_amax = 0.f;
      check(cudaMemcpyAsync(&host_amax, ramax, 4, cudaMemcpyDeviceToHost, s), "amax");
      check(cudaStreamSynchronize(s), "ref amax");
      const float ref_amax_tensor = host_amax;
      if (c.g == Granularity::kTensor) {  // ramax[0] becomes the scale: current, or given
        float sc = host_amax == 0.f ? 1.f : fp8_max / host_amax;
        if (c.given_scale) {
          sc = fp8_max / (host_amax * 1.5f);
          check(cudaMemcpyAsync(scale, &sc, 4, cudaMemcpyHostToDevice, s), "scale");
          p.scale = scale;
        }
        check(cudaMemcpyAsync(ramax, &sc, 4, cudaMemcpyHostToDevice, s), "ramax");
      }
      check(cudaMemsetAsync(rq, 0, n, s), "rq");
      check(cudaMemsetAsync(rqt, 0, n, s), "rqt");
      ref_bytes<<<int((n + 255) / 256), 256, 0, s>>>(x, rows, cols, gq, ramax, c.fmt,
                                                     c.rowwise ? rq : nullptr,
                                                     c.transposed && !two ? rqt : nullptr);
      ref_factors<<<int((count + 255) / 256), 256, 0, s>>>(ramax, count, fp8_max,
                                                           c.g == Granularity::kTensor, rfactors);
      if (two) {  // qt as its own granularity quantizes it (ramax reused: q's are done)
        ref_amax<<<int((count_t + 127) / 128), 128, 0, s>>>(x, rows, cols, gt, ramax, count_t);
        ref_bytes<<<int((n + 255) / 256), 256, 0, s>>>(x, rows, cols, gt, ramax, c.fmt, nullptr,
                                                       rqt);
        ref_factors<<<int((count_t + 255) / 256), 256, 0, s>>>(ramax, count_t, fp8_max, false,
                                                               rfactors_t);
      }
      // Poison, run, check.
      check(cudaMemsetAsync(q, 0x7F, n, s), "poison");
      check(cudaMemsetAsync(qt, 0x7F, n, s), "poison");
      check(cudaMemsetAsync(factors, 0xFF, nf * 4, s), "poison");
      check(cudaMemsetAsync(factors_t, 0xFF, nf * 4, s), "poison");
      if (!c.rowwise) check(cudaMemsetAsync(q, 0, n, s), "unused");
      if (!c.transposed) check(cudaMemsetAsync(qt, 0, n, s), "unused");
      check(pk::fp8::run(p), "quantize");
      check(cudaStreamSynchronize(s), "quantize");
      bool ok = (!c.rowwise || same(q, rq, n)) && (!c.transposed || same(qt, rqt, n)) &&
                same(factors, rfactors, count * 4) &&
                (!two || same(factors_t, rfactors_t, count_t * 4));
      if (c.g == Granularity::kTensor) {
        float got = 0.f;
        check(cudaMemcpy(&got, amax, 4, cudaMemcpyDeviceToHost), "amax");
        ok = ok && got == ref_amax_tensor;
      }
      all_ok = all_ok && ok;
      // Time: bytes read (twice for current scaling's amax pass) + written.
      const double bytes = 2.0 * n * (c.g == Granularity::kTensor && !c.given_scale ? 2 : 1) +
                           double(n) * (c.rowwise + c.transposed) + 4.0 * (count + count_t);
      float ms = 0.f;
      for (int rep = 0; rep < 2; ++rep) {
        check(cudaEventRecord(e0, s), "record");
        for (int i = 0; i < 20; ++i) check(pk::fp8::run(p), "quantize");
        check(cudaEventRecord(e1, s), "record");
        check(cudaEventSynchronize(e1), "sync");
        check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
      }
      ms /= 20;
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("| %lldx%lld | %s | %.4f | %.0f | %.2f | %s |\n", (long long)rows,
                  (long long)cols, c.name, ms, gbs, gbs / copy_gbs, ok ? "ok" : "WRONG");
    }
    free_all(x, q, qt, rq, rqt, copy, factors, rfactors, factors_t, rfactors_t, amax, ramax,
             scale);
  }
  std::printf(all_ok ? "all outputs match the reference\n" : "MISMATCH\n");
  return all_ok ? 0 : 1;
}
