// GPU check of the grouped GEMM's three kinds (needs a GPU; not run by the CPU
// test suite): bf16 operands from a fixed seed, outputs poisoned (0xFF, NaN in
// bf16) before each call, against a float64 host reference; ragged groups,
// empty groups, a negative size, a group cut at M, rows past the groups' sum.
// A case passes when the relative error (Frobenius) is below 1e-2 and every
// element the reference has as zero (rows past the sum, empty groups'
// gradients) is exactly zero.
//
// Build and run (from the repository root; one command, split here):
//   C=<nvidia-cutlass's cutlass_library/source>; nvcc -std=c++17 -O3 -DNDEBUG
//     -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DPK_HAVE_CUTLASS
//     -I csrc -I . -isystem $C/include -isystem $C/tools/util/include
//     tests/native/grouped_matmul_check.cu
//     csrc/kernels/grouped_matmul/instantiations/grouped_bf16_*.cu -o /tmp/grouped_matmul_check && /tmp/grouped_matmul_check
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/grouped_matmul/grouped_matmul.h"

using namespace pk::grouped_matmul;

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("CUDA %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

struct Case {
  int m, k, n;
  std::vector<int> sizes;
};

cudaError_t launch(const Params& p) {
  switch (p.kind) {
    case Kind::kForward: return Variant<pk::DType::kBF16, Kind::kForward>::launch(p);
    case Kind::kLhsGrad: return Variant<pk::DType::kBF16, Kind::kLhsGrad>::launch(p);
    default: return Variant<pk::DType::kBF16, Kind::kRhsGrad>::launch(p);
  }
}

// The float64 result of `kind` (grouped_matmul.h) on a, b.
std::vector<double> reference(const Case& c, Kind kind, const std::vector<double>& a,
                              const std::vector<double>& b, int64_t out_elems) {
  std::vector<double> ref(out_elems, 0.0);
  int64_t at = 0;
  for (int g = 0; g < int(c.sizes.size()); ++g) {
    const int64_t s = std::min<int64_t>(std::max(c.sizes[g], 0), c.m - at);
    const double* w = b.data() + int64_t(g) * c.k * c.n;  // rhs[g], forward and lhs grad
    for (int64_t r = at; r < at + s; ++r) {
      if (kind == Kind::kForward)
        for (int j = 0; j < c.n; ++j) {
          double acc = 0;
          for (int q = 0; q < c.k; ++q) acc += a[r * c.k + q] * w[int64_t(q) * c.n + j];
          ref[r * c.n + j] = acc;
        }
      if (kind == Kind::kLhsGrad)
        for (int q = 0; q < c.k; ++q) {
          double acc = 0;
          for (int j = 0; j < c.n; ++j) acc += a[r * c.n + j] * w[int64_t(q) * c.n + j];
          ref[r * c.k + q] = acc;
        }
    }
    if (kind == Kind::kRhsGrad)
      for (int q = 0; q < c.k; ++q)
        for (int j = 0; j < c.n; ++j) {
          double acc = 0;
          for (int64_t r = at; r < at + s; ++r) acc += a[r * c.k + q] * b[r * c.n + j];
          ref[(int64_t(g) * c.k + q) * c.n + j] = acc;
        }
    at += s;
  }
  return ref;
}

// 0 when the case passes, 1 when not.
int run_case(const Case& c, Kind kind, int sm_count) {
  const int g = int(c.sizes.size());
  std::mt19937 gen(1234 + c.m + int(kind));
  std::normal_distribution<float> normal;
  const int64_t a_elems = int64_t(c.m) * (kind == Kind::kLhsGrad ? c.n : c.k);
  const int64_t b_elems = kind == Kind::kRhsGrad ? int64_t(c.m) * c.n : int64_t(g) * c.k * c.n;
  const int64_t out_elems = kind == Kind::kForward   ? int64_t(c.m) * c.n
                            : kind == Kind::kLhsGrad ? int64_t(c.m) * c.k
                                                     : int64_t(g) * c.k * c.n;
  std::vector<__nv_bfloat16> ha(a_elems), hb(b_elems), hout(out_elems);
  std::vector<double> fa(a_elems), fb(b_elems);
  for (int64_t i = 0; i < a_elems; ++i) {
    ha[i] = __float2bfloat16(normal(gen));
    fa[i] = __bfloat162float(ha[i]);
  }
  for (int64_t i = 0; i < b_elems; ++i) {
    hb[i] = __float2bfloat16(normal(gen) * 0.1f);
    fb[i] = __bfloat162float(hb[i]);
  }
  void *a, *b, *out, *scratch;
  int32_t* sizes;
  const size_t scratch_size = scratch_bytes(g);
  CHECK_CUDA(cudaMalloc(&a, a_elems * 2));
  CHECK_CUDA(cudaMalloc(&b, b_elems * 2));
  CHECK_CUDA(cudaMalloc(&out, out_elems * 2));
  CHECK_CUDA(cudaMalloc(&scratch, scratch_size));
  CHECK_CUDA(cudaMalloc(&sizes, g * 4));
  CHECK_CUDA(cudaMemcpy(a, ha.data(), a_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, hb.data(), b_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(sizes, c.sizes.data(), g * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out, 0xFF, out_elems * 2));
  Params p;
  p.kind = kind;
  p.type = pk::DType::kBF16;
  p.rows = c.m;
  p.k = c.k;
  p.n = c.n;
  p.groups = g;
  p.group_sizes = sizes;
  p.a = a;
  p.b = b;
  p.out = out;
  p.scratch = scratch;
  p.scratch_bytes = scratch_size;
  p.sm_count = sm_count;
  CHECK_CUDA(launch(p));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(hout.data(), out, out_elems * 2, cudaMemcpyDeviceToHost));
  const std::vector<double> ref = reference(c, kind, fa, fb, out_elems);
  double num = 0, den = 0;
  int64_t bad = 0;
  for (int64_t i = 0; i < out_elems; ++i) {
    const double o = __bfloat162float(hout[i]);
    if (!std::isfinite(o) || (ref[i] == 0.0 && o != 0.0)) ++bad;
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const bool ok = bad == 0 && rel < 1e-2;
  std::printf("%s kind=%d m=%d k=%d n=%d groups=%d rel=%.2e wrong_zeros_or_nonfinite=%lld\n",
              ok ? "PASS" : "FAIL", int(kind), c.m, c.k, c.n, g, rel, static_cast<long long>(bad));
  cudaFree(a);
  cudaFree(b);
  cudaFree(out);
  cudaFree(scratch);
  cudaFree(sizes);
  return ok ? 0 : 1;
}

int main() {
  int sm_count = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  const std::vector<Case> cases = {
      {96, 64, 48, {10, 0, 30, 5}},         {64, 32, 16, {0, 64, 0}},
      {200, 128, 72, {3, 1, 150, 7, 0, 2}}, {40, 16, 8, {-5, 12, 100}},
      {1, 8, 8, {1}},                       {1000, 512, 264, {300, 0, 500, 13, 187}}};
  int failed = 0;
  for (const Case& c : cases)
    for (Kind kind : {Kind::kForward, Kind::kLhsGrad, Kind::kRhsGrad})
      failed += run_case(c, kind, sm_count);
  std::printf("GROUPED_MATMUL_CHECK %s (%d failed)\n", failed ? "FAILED" : "OK", failed);
  return failed != 0;
}
