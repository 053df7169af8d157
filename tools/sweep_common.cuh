// What the tile sweeps' drivers (tools/gemm_sweep/main.cu,
// tools/attention_sweep/main.cu) share: CUDA error checks and frees, hashed
// random inputs (a fresh seed per run) and the whole-output comparison.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace pk_sweep {

inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// cudaFree of every buffer given (any pointer types), each checked.
template <class... Ptrs>
void free_all(Ptrs... ptrs) {
  (check(cudaFree(static_cast<void*>(ptrs)), "free"), ...);
}

__device__ inline float hash_unit(size_t i, uint32_t seed) {  // in [-1, 1)
  uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
  h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
  return float(h & 0xFFFF) / 32768.0f - 1.0f;
}

// Whether configuration `index` runs: $PK_SWEEP_CONFIGS, a comma-separated
// list of configuration indices (e.g. "0,17"), picks some (to profile one
// kernel under Nsight Compute, or time a few); unset or empty, every one.
// The first configuration run of a kind is what the others are compared with.
inline bool selected(int index) {
  const char* list = std::getenv("PK_SWEEP_CONFIGS");
  if (list == nullptr || *list == '\0') return true;
  for (const char* at = list; *at != '\0';) {
    char* end = nullptr;
    const long i = std::strtol(at, &end, 10);
    if (end == at) {
      std::fprintf(stderr, "PK_SWEEP_CONFIGS=%s: want indices like 0,17\n", list);
      std::exit(2);
    }
    if (i == index) return true;
    at = *end == ',' ? end + 1 : end;
  }
  return false;
}

// Values from a hash of the index and a seed, times `scale`.
__global__ void fill(__nv_bfloat16* x, size_t count, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(scale * hash_unit(i, seed));
}

// *result (zeroed by the caller) = max |x - y|, infinity where either is NaN.
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

// Enqueues *host = max |x - y| over `count` elements (0 where !compare: the
// first configuration has nothing to compare with), through the device float
// `scratch`; *host is valid once `stream` is synchronized.
inline void enqueue_vs_first(const __nv_bfloat16* x, const __nv_bfloat16* y, size_t count,
                             bool compare, float* scratch, float* host, cudaStream_t stream) {
  check(cudaMemsetAsync(scratch, 0, sizeof(float), stream), "diff");
  if (compare) max_abs_diff<<<1024, 256, 0, stream>>>(x, y, count, scratch);
  check(cudaMemcpyAsync(host, scratch, sizeof(float), cudaMemcpyDeviceToHost, stream), "diff");
}

}  // namespace pk_sweep
