// tools/gemm_sweep: time the sm90 GEMM's tile configurations (config.cu) and
// tile swizzles on one GPU at the shapes the tensor-parallel ops run, bf16 in
// and out. Every configuration's output is checked first: sampled elements
// against an fp32 reference kernel, and the whole output against
// configuration 0's. Usage: gemm_sweep [M,N,K ...]; prints one row per
// (shape, configuration, swizzle) and the best per shape.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.h"

#define PK_SWEEP_DECLARE(i)                                                          \
  const char* pk_sweep_name_##i();                                                  \
  cudaError_t pk_sweep_run_##i(const pk::gemm::Problem&, const pk::gemm::Device&, \
                               cudaStream_t, int);
PK_SWEEP_DECLARE(0)
PK_SWEEP_DECLARE(1)
PK_SWEEP_DECLARE(2)
PK_SWEEP_DECLARE(3)
PK_SWEEP_DECLARE(4)
PK_SWEEP_DECLARE(5)

namespace {

struct Config {
  const char* (*name)();
  cudaError_t (*run)(const pk::gemm::Problem&, const pk::gemm::Device&, cudaStream_t, int);
};
const Config kConfigs[] = {{pk_sweep_name_0, pk_sweep_run_0}, {pk_sweep_name_1, pk_sweep_run_1},
                           {pk_sweep_name_2, pk_sweep_run_2}, {pk_sweep_name_3, pk_sweep_run_3},
                           {pk_sweep_name_4, pk_sweep_run_4}, {pk_sweep_name_5, pk_sweep_run_5}};
constexpr int kSwizzles[] = {1, 2, 4, 8};
constexpr int kWarmup = 3, kIters = 20, kSamples = 4096;

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// Values in [-1, 1) from a hash of the index and a seed (fresh per run).
__global__ void fill(__nv_bfloat16* x, size_t count, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = __float2bfloat16(scale * (float(h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

// fp32 dot products of sampled output elements (row-major A [m, k], B [k, n]).
__global__ void reference(const __nv_bfloat16* a, const __nv_bfloat16* b, const int* rows,
                          const int* cols, float* out, int samples, int n, int k) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= samples) return;
  float acc = 0.f;
  for (int i = 0; i < k; ++i)
    acc += __bfloat162float(a[size_t(rows[s]) * k + i]) * __bfloat162float(b[size_t(i) * n + cols[s]]);
  out[s] = acc;
}

__global__ void gather(const __nv_bfloat16* d, const int* rows, const int* cols, float* out,
                       int samples, int n) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < samples) out[s] = __bfloat162float(d[size_t(rows[s]) * n + cols[s]]);
}

__global__ void max_abs_diff(const __nv_bfloat16* x, const __nv_bfloat16* y, size_t count,
                             float* result) {
  float m = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = fabsf(__bfloat162float(x[i]) - __bfloat162float(y[i]));
    m = isnan(v) ? INFINITY : fmaxf(m, v);  // fmaxf would drop a NaN (unwritten poison)
  }
  atomicMax(reinterpret_cast<int*>(result), __float_as_int(m));  // m >= 0: int order = float order
}

struct Shape { int m, n, k; };

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    Shape s{};
    if (std::sscanf(argv[i], "%d,%d,%d", &s.m, &s.n, &s.k) != 3) {
      std::fprintf(stderr, "bad shape %s (want M,N,K)\n", argv[i]);
      return 2;
    }
    shapes.push_back(s);
  }
  if (shapes.empty())  // the chunk GEMMs of benchmarks/tp_matmul.py on 2 GPUs, and 8192^3
    shapes = {{8192, 8192, 8192}, {4096, 8192, 8192}, {2048, 4096, 4096},
              {8192, 14336, 8192}, {8192, 8192, 14336}};
  int dev_id = 0;
  check(cudaGetDevice(&dev_id), "cudaGetDevice");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, dev_id), "cudaGetDeviceProperties");
  pk::gemm::Device dev{dev_id, prop.multiProcessorCount, nullptr, size_t(64) << 20};
  check(cudaMalloc(&dev.workspace, dev.workspace_bytes), "workspace");
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("| M x N x K | config | swizzle | ms | TFLOP/s | check |\n| --- | --- | --- | --- | --- | --- |\n");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaEvent_t t0, t1;
  check(cudaEventCreate(&t0), "event");
  check(cudaEventCreate(&t1), "event");
  const uint32_t seed = uint32_t(std::random_device{}());
  std::string best;
  for (const Shape& s : shapes) {
    __nv_bfloat16 *a, *b, *d, *d0;
    check(cudaMalloc(&a, size_t(s.m) * s.k * 2), "a");
    check(cudaMalloc(&b, size_t(s.k) * s.n * 2), "b");
    check(cudaMalloc(&d, size_t(s.m) * s.n * 2), "d");
    check(cudaMalloc(&d0, size_t(s.m) * s.n * 2), "d0");
    fill<<<1024, 256, 0, stream>>>(a, size_t(s.m) * s.k, seed, 1.0f);
    fill<<<1024, 256, 0, stream>>>(b, size_t(s.k) * s.n, seed * 7u + 1u, 1.0f / std::sqrt(float(s.k)));
    // Sampled elements and their fp32 reference.
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
    reference<<<kSamples / 128, 128, 0, stream>>>(a, b, rows_d, cols_d, ref, kSamples, s.n, s.k);
    std::vector<float> ref_h(kSamples), got_h(kSamples);
    check(cudaMemcpyAsync(ref_h.data(), ref, kSamples * 4, cudaMemcpyDeviceToHost, stream), "ref");
    check(cudaStreamSynchronize(stream), "reference");
    double best_ms = 1e30;
    std::string best_name;
    for (int c = 0; c < int(sizeof(kConfigs) / sizeof(kConfigs[0])); ++c) {
      pk::gemm::Problem p;
      p.m = s.m; p.n = s.n; p.k = s.k; p.a = a; p.b = b; p.d = c == 0 ? d0 : d;
      // Poison the output, run once, check.
      check(cudaMemsetAsync(p.d, 0xFF, size_t(s.m) * s.n * 2, stream), "poison");
      cudaError_t e = kConfigs[c].run(p, dev, stream, 1);
      if (e != cudaSuccess) {
        std::printf("| %dx%dx%d | %s | - | - | - | not run: %s |\n", s.m, s.n, s.k,
                    kConfigs[c].name(), cudaGetErrorString(e));
        continue;
      }
      gather<<<kSamples / 128, 128, 0, stream>>>(static_cast<__nv_bfloat16*>(p.d), rows_d, cols_d,
                                                 got, kSamples, s.n);
      check(cudaMemcpyAsync(got_h.data(), got, kSamples * 4, cudaMemcpyDeviceToHost, stream), "got");
      float worst = 0.f;
      check(cudaMemsetAsync(diff, 0, 4, stream), "diff");
      if (c > 0)
        max_abs_diff<<<1024, 256, 0, stream>>>(d, d0, size_t(s.m) * s.n, diff);
      float vs0 = 0.f;
      check(cudaMemcpyAsync(&vs0, diff, 4, cudaMemcpyDeviceToHost, stream), "diff");
      check(cudaStreamSynchronize(stream), "check");
      for (int i = 0; i < kSamples; ++i) {  // bf16 output: 2^-9 relative, plus slack
        const float err = std::fabs(got_h[i] - ref_h[i]) / (std::fabs(ref_h[i]) + 0.05f);
        worst = std::isfinite(err) ? std::fmax(worst, err) : INFINITY;  // NaN: poison left
      }
      const bool ok = worst < 1.5e-2f && vs0 < 0.1f && std::isfinite(vs0);
      for (int sw : kSwizzles) {
        for (int i = 0; i < kWarmup; ++i) check(kConfigs[c].run(p, dev, stream, sw), "warmup");
        check(cudaEventRecord(t0, stream), "record");
        for (int i = 0; i < kIters; ++i) check(kConfigs[c].run(p, dev, stream, sw), "run");
        check(cudaEventRecord(t1, stream), "record");
        check(cudaEventSynchronize(t1), "sync");
        float ms = 0.f;
        check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
        ms /= kIters;
        const double tflops = 2.0 * s.m * s.n * s.k / (ms * 1e-3) / 1e12;
        std::printf("| %dx%dx%d | %s | %d | %.3f | %.0f | %s (rel %.1e, vs config 0 %.1e) |\n",
                    s.m, s.n, s.k, kConfigs[c].name(), sw, ms, tflops, ok ? "ok" : "WRONG",
                    worst, vs0);
        if (ok && ms < best_ms) {
          best_ms = ms;
          best_name = std::string(kConfigs[c].name()) + ", swizzle " + std::to_string(sw);
        }
      }
    }
    char line[256];
    std::snprintf(line, sizeof(line), "best %dx%dx%d: %s, %.3f ms, %.0f TFLOP/s\n", s.m, s.n,
                  s.k, best_name.c_str(), best_ms, 2.0 * s.m * s.n * s.k / (best_ms * 1e-3) / 1e12);
    best += line;
    for (void* ptr : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(d),
                      static_cast<void*>(d0), static_cast<void*>(rows_d), static_cast<void*>(cols_d),
                      static_cast<void*>(ref), static_cast<void*>(got), static_cast<void*>(diff)})
      check(cudaFree(ptr), "free");
  }
  std::printf("%s", best.c_str());
  return 0;
}
