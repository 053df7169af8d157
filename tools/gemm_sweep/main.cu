// tools/gemm_sweep: time the sm90 GEMMs' tile configurations (config.cu) and
// tile swizzles on one GPU at the shapes LLM layers run: bf16 in and out, and
// FP8 (e4m3) with per-tensor or block factors, bf16 out. Every
// configuration's output is checked first: sampled elements against an fp32
// reference kernel, and the whole output against the first configuration of
// its kind ($PK_SWEEP_CONFIGS: only those configurations, tools/sweep.sh).
// The gradient kinds (3: e5m2 x e4m3, the input gradient's operands; 4: e4m3
// x e5m2, the weight gradient's) run per-tensor factors like kind 1.
// Usage: gemm_sweep [M,N,K ...]; prints the shapes (a line
// "shapes M,N,K ..."), one row per (shape, configuration, swizzle) and the
// best per (shape, kind). $PK_SWEEP_SWIZZLES picks the swizzles and their
// order (swizzles() below).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.h"
#include "tools/sweep_common.cuh"

#define PK_SWEEP_DECLARE(i)                                                          \
  const char* pk_sweep_name_##i();                                                  \
  int pk_sweep_kind_##i();                                                          \
  cudaError_t pk_sweep_run_##i(const pk::gemm::Problem&, const pk::gemm::Device&, \
                               cudaStream_t, int);
PK_SWEEP_DECLARE(0)
PK_SWEEP_DECLARE(1)
PK_SWEEP_DECLARE(2)
PK_SWEEP_DECLARE(3)
PK_SWEEP_DECLARE(4)
PK_SWEEP_DECLARE(5)
PK_SWEEP_DECLARE(6)
PK_SWEEP_DECLARE(7)
PK_SWEEP_DECLARE(8)
PK_SWEEP_DECLARE(9)
PK_SWEEP_DECLARE(10)
PK_SWEEP_DECLARE(11)
PK_SWEEP_DECLARE(12)
PK_SWEEP_DECLARE(13)
PK_SWEEP_DECLARE(14)
PK_SWEEP_DECLARE(15)
PK_SWEEP_DECLARE(16)
PK_SWEEP_DECLARE(17)
PK_SWEEP_DECLARE(18)
PK_SWEEP_DECLARE(19)
PK_SWEEP_DECLARE(20)
PK_SWEEP_DECLARE(21)
PK_SWEEP_DECLARE(22)
PK_SWEEP_DECLARE(23)
PK_SWEEP_DECLARE(24)
PK_SWEEP_DECLARE(25)
PK_SWEEP_DECLARE(26)
PK_SWEEP_DECLARE(27)
PK_SWEEP_DECLARE(28)
PK_SWEEP_DECLARE(29)
PK_SWEEP_DECLARE(30)

namespace {

using pk_sweep::check;
using pk_sweep::enqueue_vs_first;
using pk_sweep::fill;
using pk_sweep::free_all;
using pk_sweep::hash_unit;

struct Config {
  const char* (*name)();
  int (*kind)();
  cudaError_t (*run)(const pk::gemm::Problem&, const pk::gemm::Device&, cudaStream_t, int);
};
#define PK_SWEEP_ENTRY(i) {pk_sweep_name_##i, pk_sweep_kind_##i, pk_sweep_run_##i}
const Config kConfigs[] = {PK_SWEEP_ENTRY(0),  PK_SWEEP_ENTRY(1),  PK_SWEEP_ENTRY(2),
                           PK_SWEEP_ENTRY(3),  PK_SWEEP_ENTRY(4),  PK_SWEEP_ENTRY(5),
                           PK_SWEEP_ENTRY(6),  PK_SWEEP_ENTRY(7),  PK_SWEEP_ENTRY(8),
                           PK_SWEEP_ENTRY(9),  PK_SWEEP_ENTRY(10), PK_SWEEP_ENTRY(11),
                           PK_SWEEP_ENTRY(12), PK_SWEEP_ENTRY(13), PK_SWEEP_ENTRY(14),
                           PK_SWEEP_ENTRY(15), PK_SWEEP_ENTRY(16), PK_SWEEP_ENTRY(17),
                           PK_SWEEP_ENTRY(18), PK_SWEEP_ENTRY(19), PK_SWEEP_ENTRY(20),
                           PK_SWEEP_ENTRY(21), PK_SWEEP_ENTRY(22), PK_SWEEP_ENTRY(23),
                           PK_SWEEP_ENTRY(24), PK_SWEEP_ENTRY(25), PK_SWEEP_ENTRY(26),
                           PK_SWEEP_ENTRY(27), PK_SWEEP_ENTRY(28), PK_SWEEP_ENTRY(29),
                           PK_SWEEP_ENTRY(30)};  // config.cu's 31
constexpr const char* kKindNames[] = {"bf16", "fp8 tensor", "fp8 block", "fp8 dgrad",
                                      "fp8 wgrad"};
constexpr int kKinds = int(sizeof(kKindNames) / sizeof(kKindNames[0]));
// The tile swizzles timed, in order: $PK_SWEEP_SWIZZLES, a comma-separated list
// of 1, 2, 4 and 8 (e.g. "8,1": for an A/B, alternate the order between runs, as
// the later launches meet a hotter GPU); unset or empty, 1,2,4,8.
std::vector<int> swizzles() {
  const char* list = std::getenv("PK_SWEEP_SWIZZLES");
  if (list == nullptr || *list == '\0') return {1, 2, 4, 8};
  std::vector<int> out;
  for (const char* at = list; *at != '\0';) {
    char* end = nullptr;
    const long sw = std::strtol(at, &end, 10);
    if (end == at || (sw != 1 && sw != 2 && sw != 4 && sw != 8)) {
      std::fprintf(stderr, "PK_SWEEP_SWIZZLES=%s: want swizzles of 1, 2, 4, 8 like 8,1\n", list);
      std::exit(2);
    }
    out.push_back(int(sw));
    at = *end == ',' ? end + 1 : end;
  }
  return out;
}
constexpr int kWarmup = 3, kIters = 20, kSamples = 4096;

__global__ void fill_fp8(__nv_fp8_e4m3* x, size_t count, uint32_t seed) {  // |x| < 4
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = __nv_fp8_e4m3(4.0f * hash_unit(i, seed));
}
__global__ void fill_e5m2(__nv_fp8_e5m2* x, size_t count, uint32_t seed) {  // |x| < 4
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = __nv_fp8_e5m2(4.0f * hash_unit(i, seed));
}
__global__ void fill_factors(float* x, size_t count, uint32_t seed) {  // in [0.5, 1.5)
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = 1.0f + 0.5f * hash_unit(i, seed);
}

// fp32 dot products of sampled output elements. bf16: A [m, k], B [k, n]
// row-major. fp8: A [m, k], B [n, k] with factors (kind 1: sa[0], sb[0];
// kind 2: sa [k/128, m], sb [k/128, n/128]; kinds 3 and 4 as 1, A or B e5m2).
__global__ void reference(int kind, const void* a, const void* b, const float* sa,
                          const float* sb, const int* rows, const int* cols, float* out,
                          int samples, int m, int n, int k) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= samples) return;
  const size_t r = rows[s], c = cols[s];
  float acc = 0.f;
  for (int i = 0; i < k; ++i) {
    if (kind == 0) {
      acc += __bfloat162float(static_cast<const __nv_bfloat16*>(a)[r * k + i]) *
             __bfloat162float(static_cast<const __nv_bfloat16*>(b)[size_t(i) * n + c]);
    } else {
      const float x = kind == 3 ? float(static_cast<const __nv_fp8_e5m2*>(a)[r * k + i])
                                : float(static_cast<const __nv_fp8_e4m3*>(a)[r * k + i]);
      const float y = kind == 4 ? float(static_cast<const __nv_fp8_e5m2*>(b)[c * k + i])
                                : float(static_cast<const __nv_fp8_e4m3*>(b)[c * k + i]);
      const float f = kind != 2 ? sa[0] * sb[0]
                                : sa[size_t(i / 128) * m + r] * sb[size_t(i / 128) * ((n + 127) / 128) + c / 128];
      acc += x * y * f;
    }
  }
  out[s] = acc;
}

__global__ void gather(const __nv_bfloat16* d, const int* rows, const int* cols, float* out,
                       int samples, int n) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < samples) out[s] = __bfloat162float(d[size_t(rows[s]) * n + cols[s]]);
}

struct Shape { int m, n, k; };

}  // namespace

int main(int argc, char** argv) {
  const std::vector<int> swizzle_order = swizzles();
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    Shape s{};
    if (std::sscanf(argv[i], "%d,%d,%d", &s.m, &s.n, &s.k) != 3) {
      std::fprintf(stderr, "bad shape %s (want M,N,K)\n", argv[i]);
      return 2;
    }
    shapes.push_back(s);
  }
  if (shapes.empty())  // benchmarks/kernels.py's GEMM table (M x N x K)
    shapes = {{8192, 8192, 8192}, {4096, 4096, 4096}, {8192, 14336, 4096},
              {8192, 4096, 14336}, {8192, 6144, 4096}, {8192, 28672, 8192},
              {8192, 8192, 28672}, {8192, 3584, 8192}, {8192, 8192, 3584},
              {8192, 18432, 7168}, {2048, 14336, 4096}};
  int dev_id = 0;
  check(cudaGetDevice(&dev_id), "cudaGetDevice");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, dev_id), "cudaGetDeviceProperties");
  pk::gemm::Device dev{dev_id, prop.multiProcessorCount, nullptr, size_t(256) << 20};
  check(cudaMalloc(&dev.workspace, dev.workspace_bytes), "workspace");
  std::printf("shapes");  // tools/sweep.sh times XLA's dot at these
  for (const Shape& s : shapes) std::printf(" %d,%d,%d", s.m, s.n, s.k);
  std::printf("\n%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("| M x N x K | config | swizzle | ms | TFLOP/s | check |\n| --- | --- | --- | --- | --- | --- |\n");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaEvent_t t0, t1;
  check(cudaEventCreate(&t0), "event");
  check(cudaEventCreate(&t1), "event");
  const uint32_t seed = uint32_t(std::random_device{}());
  std::string best;
  constexpr int kConfigCount = int(sizeof(kConfigs) / sizeof(kConfigs[0]));
  for (const Shape& s : shapes) {
    const size_t mk = size_t(s.m) * s.k, kn = size_t(s.k) * s.n, mn = size_t(s.m) * s.n;
    const size_t kb = (s.k + 127) / 128, nb = (s.n + 127) / 128;
    __nv_bfloat16 *a, *b, *d, *d0;
    __nv_fp8_e4m3 *a8, *b8;
    __nv_fp8_e5m2 *a5, *b5;
    float *sa, *sb;
    check(cudaMalloc(&a, mk * 2), "a");
    check(cudaMalloc(&b, kn * 2), "b");
    check(cudaMalloc(&a8, mk), "a8");
    check(cudaMalloc(&b8, kn), "b8");
    check(cudaMalloc(&a5, mk), "a5");
    check(cudaMalloc(&b5, kn), "b5");
    check(cudaMalloc(&sa, kb * s.m * 4), "sa");
    check(cudaMalloc(&sb, kb * nb * 4), "sb");
    check(cudaMalloc(&d, mn * 2), "d");
    check(cudaMalloc(&d0, mn * 2), "d0");
    fill<<<1024, 256, 0, stream>>>(a, mk, seed, 1.0f);
    fill<<<1024, 256, 0, stream>>>(b, kn, seed * 7u + 1u, 1.0f / std::sqrt(float(s.k)));
    fill_fp8<<<1024, 256, 0, stream>>>(a8, mk, seed * 3u + 2u);
    fill_fp8<<<1024, 256, 0, stream>>>(b8, kn, seed * 5u + 3u);
    fill_e5m2<<<1024, 256, 0, stream>>>(a5, mk, seed * 17u + 6u);
    fill_e5m2<<<1024, 256, 0, stream>>>(b5, kn, seed * 19u + 7u);
    // kind 2 reads sa [k/128, m] and sb [k/128, n/128]; kind 1 their first entries
    fill_factors<<<64, 256, 0, stream>>>(sa, kb * s.m, seed * 11u + 4u);
    fill_factors<<<64, 256, 0, stream>>>(sb, kb * nb, seed * 13u + 5u);
    std::vector<int> rows(kSamples), cols(kSamples);
    for (int i = 0; i < kSamples; ++i) {
      rows[i] = int((uint64_t(i) * 2654435761u + seed) % uint64_t(s.m));
      cols[i] = int((uint64_t(i) * 40503u + seed / 3) % uint64_t(s.n));
    }
    int *rows_d, *cols_d;
    float *ref, *got, *diff;
    check(cudaMalloc(&rows_d, kSamples * 4), "rows");
    check(cudaMalloc(&cols_d, kSamples * 4), "cols");
    check(cudaMalloc(&ref, kSamples * 4), "ref");
    check(cudaMalloc(&got, kSamples * 4), "got");
    check(cudaMalloc(&diff, 4), "diff");
    check(cudaMemcpy(rows_d, rows.data(), kSamples * 4, cudaMemcpyHostToDevice), "rows");
    check(cudaMemcpy(cols_d, cols.data(), kSamples * 4, cudaMemcpyHostToDevice), "cols");
    std::vector<float> got_h(kSamples);
    for (int kind = 0; kind < kKinds; ++kind) {
      std::vector<float> ref_h(kSamples);
      const void* pa = kind == 0 ? static_cast<const void*>(a) : kind == 3 ? static_cast<const void*>(a5) : a8;
      const void* pb = kind == 0 ? static_cast<const void*>(b) : kind == 4 ? static_cast<const void*>(b5) : b8;
      reference<<<kSamples / 128, 128, 0, stream>>>(kind, pa, pb, sa, sb, rows_d, cols_d, ref,
                                                    kSamples, s.m, s.n, s.k);
      check(cudaMemcpyAsync(ref_h.data(), ref, kSamples * 4, cudaMemcpyDeviceToHost, stream), "ref");
      check(cudaStreamSynchronize(stream), "reference");
      double best_ms = 1e30;
      std::string best_name;
      bool first = true;
      for (int c = 0; c < kConfigCount; ++c) {
        if (kConfigs[c].kind() != kind || !pk_sweep::selected(c)) continue;
        pk::gemm::Problem p;
        p.m = s.m; p.n = s.n; p.k = s.k; p.a = pa; p.b = pb; p.d = first ? d0 : d;
        if (kind > 0) {
          p.in = kind == 3 ? pk::DType::kE5M2 : pk::DType::kE4M3;
          p.in_b = kind == 4 ? pk::DType::kE5M2 : pk::DType::kE4M3;
          p.b_transposed = true;
          p.scaling = kind == 2 ? pk::gemm::Scaling::kBlock : pk::gemm::Scaling::kTensor;
          p.scale_a = sa;
          p.scale_b = sb;
        }
        // Poison the output, run once, check.
        check(cudaMemsetAsync(p.d, 0xFF, mn * 2, stream), "poison");
        cudaError_t e = kConfigs[c].run(p, dev, stream, 1);
        if (e != cudaSuccess) {
          std::printf("| %dx%dx%d | %s | - | - | - | not run: %s |\n", s.m, s.n, s.k,
                      kConfigs[c].name(), cudaGetErrorString(e));
          continue;
        }
        gather<<<kSamples / 128, 128, 0, stream>>>(static_cast<__nv_bfloat16*>(p.d), rows_d,
                                                   cols_d, got, kSamples, s.n);
        check(cudaMemcpyAsync(got_h.data(), got, kSamples * 4, cudaMemcpyDeviceToHost, stream), "got");
        float vs0 = 0.f;
        enqueue_vs_first(d, d0, mn, !first, diff, &vs0, stream);
        check(cudaStreamSynchronize(stream), "check");
        // relative to the row's scale: bf16 output 2^-9, fast FP8 accumulation more
        const float scale = kind == 0 ? 1.0f : 4.0f * std::sqrt(float(s.k));
        float worst = 0.f;
        double err2 = 0.0, ref2 = 0.0;
        for (int i = 0; i < kSamples; ++i) {
          const float err = std::fabs(got_h[i] - ref_h[i]) / (std::fabs(ref_h[i]) + 0.05f * scale);
          worst = std::isfinite(err) ? std::fmax(worst, err) : INFINITY;  // NaN: poison left
          err2 += double(got_h[i] - ref_h[i]) * double(got_h[i] - ref_h[i]);
          ref2 += double(ref_h[i]) * double(ref_h[i]);
        }
        // Per-tensor FP8 runs fast accumulation, whose worst element at large K
        // exceeds an elementwise bound: the samples' relative L2 error is held
        // to tests/test_fp8_gpu.py's Frobenius bound (1e-2) instead.
        const float rel_l2 = float(std::sqrt(err2 / std::fmax(ref2, 1e-30)));
        const bool tensor = kind == 1 || kind >= 3;
        const bool close = tensor ? (std::isfinite(worst) && rel_l2 < 1e-2f)
                                  : worst < (kind == 0 ? 1.5e-2f : 3e-2f);
        if (tensor) worst = rel_l2;  // what the row reports as "rel"
        const bool ok = close && std::isfinite(vs0) && vs0 < 0.1f * scale;
        first = false;
        for (int sw : swizzle_order) {
          for (int i = 0; i < kWarmup; ++i) check(kConfigs[c].run(p, dev, stream, sw), "warmup");
          check(cudaEventRecord(t0, stream), "record");
          for (int i = 0; i < kIters; ++i) check(kConfigs[c].run(p, dev, stream, sw), "run");
          check(cudaEventRecord(t1, stream), "record");
          check(cudaEventSynchronize(t1), "sync");
          float ms = 0.f;
          check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
          ms /= kIters;
          const double tflops = 2.0 * s.m * s.n * s.k / (ms * 1e-3) / 1e12;
          std::printf("| %dx%dx%d | %s | %d | %.3f | %.0f | %s (rel %.1e, vs first %.1e) |\n",
                      s.m, s.n, s.k, kConfigs[c].name(), sw, ms, tflops, ok ? "ok" : "WRONG",
                      worst, vs0);
          if (ok && ms < best_ms) {
            best_ms = ms;
            best_name = std::string(kConfigs[c].name()) + ", swizzle " + std::to_string(sw);
          }
        }
      }
      char line[256];
      std::snprintf(line, sizeof(line), "best %s %dx%dx%d: %s, %.3f ms, %.0f TFLOP/s\n",
                    kKindNames[kind], s.m, s.n, s.k, best_name.c_str(), best_ms,
                    2.0 * s.m * s.n * s.k / (best_ms * 1e-3) / 1e12);
      best += line;
      std::fflush(stdout);
    }
    free_all(a, b, a8, b8, a5, b5, sa, sb, d, d0, rows_d, cols_d, ref, got, diff);
  }
  std::printf("%s", best.c_str());
  return 0;
}
