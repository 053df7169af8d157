// tools/attention_sweep: time the fused ring attention kernel's forward
// configurations (config.cu: keys per tile, K/V stages, mainloop variants;
// head dims 64, 128, 256) on one GPU, bf16, on a ring of one, at the
// shapes of
// benchmarks/kernels.py's attention table. Every configuration's output is
// checked before it is timed: sampled query rows (output and log-sum-exp)
// against an fp32 reference kernel, and the whole output against the first
// configuration of its head dim; outputs are poisoned (NaN) before each
// checked run ($PK_SWEEP_CONFIGS: only those configurations, tools/sweep.sh).
// Usage: attention_sweep [B,S,HQ,HKV,D,CAUSAL ...]; prints the
// shapes (a line "shapes B,S,HQ,HKV,D,CAUSAL ..."), one row per (shape,
// configuration) and the best per shape.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "pk/layout.h"
#include "tools/attention_sweep/sweep.h"
#include "tools/sweep_common.cuh"

std::vector<pk_sweep::Config>& pk_sweep::configs() {
  static std::vector<Config> all;
  return all;
}

namespace {

using pk_sweep::check;
using pk_sweep::enqueue_vs_first;
using pk_sweep::fill;
using pk_sweep::free_all;

constexpr int kWarmup = 3, kIters = 20, kSamples = 256;

struct Shape { int b, s, hq, hkv, d, causal; };
struct Sample { int b, h, row; };

// fp32 attention of one sampled query row per block (q, k, v [B, S, H, D]
// bf16; key j visible to row i when !causal or j <= i): its output [D] and
// log-sum-exp (natural log, scale included, as the kernel writes it).
// `scores` holds S floats per sample.
__global__ void reference(const __nv_bfloat16* q, const __nv_bfloat16* k,
                          const __nv_bfloat16* v, Shape sh, float scale, const Sample* samples,
                          float* scores, float* out, float* lse) {
  __shared__ float qrow[256];
  __shared__ float red[128];
  const Sample smp = samples[blockIdx.x];
  const int kvh = smp.h / (sh.hq / sh.hkv), tid = threadIdx.x;
  const size_t q_off = ((size_t(smp.b) * sh.s + smp.row) * sh.hq + smp.h) * sh.d;
  for (int c = tid; c < sh.d; c += blockDim.x) qrow[c] = __bfloat162float(q[q_off + c]);
  __syncthreads();
  const int keys = sh.causal ? smp.row + 1 : sh.s;
  float* sc = scores + size_t(blockIdx.x) * sh.s;
  auto kv_at = [&](int j) { return ((size_t(smp.b) * sh.s + j) * sh.hkv + kvh) * sh.d; };
  auto block_reduce = [&](float x, bool is_max) {
    red[tid] = x;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
      if (tid < w) red[tid] = is_max ? fmaxf(red[tid], red[tid + w]) : red[tid] + red[tid + w];
      __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
  };
  float mx = -INFINITY;
  for (int j = tid; j < keys; j += blockDim.x) {
    float dot = 0.f;
    for (int c = 0; c < sh.d; ++c) dot += qrow[c] * __bfloat162float(k[kv_at(j) + c]);
    sc[j] = dot * scale;
    mx = fmaxf(mx, sc[j]);
  }
  mx = block_reduce(mx, true);
  float sum = 0.f;
  for (int j = tid; j < keys; j += blockDim.x) {
    sc[j] = expf(sc[j] - mx);
    sum += sc[j];
  }
  sum = block_reduce(sum, false);  // its barriers also publish sc[]
  for (int c = tid; c < sh.d; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < keys; ++j) acc += sc[j] * __bfloat162float(v[kv_at(j) + c]);
    out[size_t(blockIdx.x) * sh.d + c] = acc / sum;
  }
  if (tid == 0) lse[blockIdx.x] = mx + logf(sum);
}

// The kernel's output rows and log-sum-exps at the samples.
__global__ void gather(const __nv_bfloat16* o, const float* lse, Shape sh, const Sample* samples,
                       float* out, float* out_lse) {
  const Sample smp = samples[blockIdx.x];
  const size_t off = ((size_t(smp.b) * sh.s + smp.row) * sh.hq + smp.h) * sh.d;
  for (int c = threadIdx.x; c < sh.d; c += blockDim.x)
    out[size_t(blockIdx.x) * sh.d + c] = __bfloat162float(o[off + c]);
  if (threadIdx.x == 0)
    out_lse[blockIdx.x] = lse[(size_t(smp.b) * sh.hq + smp.h) * sh.s + smp.row];
}

double flops(const Shape& s) {  // 4 B S^2 H D, half of it causal
  return 4.0 * s.b * double(s.s) * s.s * s.hq * s.d * (s.causal ? 0.5 : 1.0);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes;
  for (int i = 1; i < argc; ++i) {
    Shape s{};
    if (std::sscanf(argv[i], "%d,%d,%d,%d,%d,%d", &s.b, &s.s, &s.hq, &s.hkv, &s.d, &s.causal) != 6 ||
        s.b < 1 || s.s < 128 || s.s % 128 || s.hkv < 1 || s.hq % s.hkv || s.d > 256) {
      std::fprintf(stderr, "bad shape %s (want B,S,HQ,HKV,D,CAUSAL; S a multiple of 128)\n", argv[i]);
      return 2;
    }
    shapes.push_back(s);
  }
  if (shapes.empty())  // benchmarks/kernels.py's attention table (bf16), and both masks
    shapes = {{1, 8192, 16, 16, 128, 0}, {1, 8192, 16, 16, 128, 1}, {1, 16384, 16, 16, 64, 1},
              {1, 16384, 16, 16, 64, 0}, {1, 32768, 8, 8, 128, 1},  {1, 8192, 32, 8, 128, 1},
              {4, 4096, 16, 16, 128, 1}, {1, 8192, 8, 8, 256, 1},   {1, 8192, 8, 8, 256, 0}};
  int dev_id = 0;
  check(cudaGetDevice(&dev_id), "cudaGetDevice");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, dev_id), "cudaGetDeviceProperties");
  std::printf("shapes");  // tools/sweep.sh times cuDNN at these
  for (const Shape& s : shapes) std::printf(" %d,%d,%d,%d,%d,%d", s.b, s.s, s.hq, s.hkv, s.d, s.causal);
  std::printf("\n%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::vector<pk_sweep::Config> configs = pk_sweep::configs();
  std::sort(configs.begin(), configs.end(),
            [](const auto& a, const auto& b) { return a.index < b.index; });
  if (configs.empty()) return std::fprintf(stderr, "no configuration linked in\n"), 1;
  for (const auto& c : configs) check(c.load(), c.name);
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaEvent_t t0, t1;
  check(cudaEventCreate(&t0), "event");
  check(cudaEventCreate(&t1), "event");
  // A ring of one never waits on its channel (nor reads its epoch); the
  // kernel takes the flags as arguments all the same.
  pk::SlotFlags* flags;
  check(cudaMalloc(&flags, sizeof(pk::SlotFlags)), "flags");
  check(cudaMemset(flags, 0, sizeof(pk::SlotFlags)), "flags");
  // The device's error word, as the ops pass it (zero: nothing failed): the
  // kernel reads it as each tile begins, so the sweep times that read too.
  int32_t* claim;
  check(cudaMalloc(&claim, sizeof(int32_t)), "claim");
  check(cudaMemset(claim, 0, sizeof(int32_t)), "claim");
  const uint32_t seed = uint32_t(std::random_device{}());
  std::printf("| B, S, Hq/Hkv, D, mask | config | ms | TFLOP/s | check |\n| --- | --- | --- | --- | --- |\n");
  std::string best;
  for (const Shape& s : shapes) {
    const size_t q_elems = size_t(s.b) * s.s * s.hq * s.d, kv_elems = size_t(s.b) * s.s * s.hkv * s.d;
    const size_t rows = size_t(s.b) * s.hq * s.s;
    __nv_bfloat16 *q, *k, *v, *o, *o0;
    float *lse, *scores, *ref, *ref_lse, *got, *got_lse, *diff;
    Sample* samples_d;
    check(cudaMalloc(&q, q_elems * 2), "q");
    check(cudaMalloc(&k, kv_elems * 2), "k");
    check(cudaMalloc(&v, kv_elems * 2), "v");
    check(cudaMalloc(&o, q_elems * 2), "o");
    check(cudaMalloc(&o0, q_elems * 2), "o0");
    check(cudaMalloc(&lse, rows * 4), "lse");
    check(cudaMalloc(&scores, size_t(kSamples) * s.s * 4), "scores");
    check(cudaMalloc(&ref, size_t(kSamples) * s.d * 4), "ref");
    check(cudaMalloc(&got, size_t(kSamples) * s.d * 4), "got");
    check(cudaMalloc(&ref_lse, kSamples * 4), "ref_lse");
    check(cudaMalloc(&got_lse, kSamples * 4), "got_lse");
    check(cudaMalloc(&diff, 4), "diff");
    check(cudaMalloc(&samples_d, kSamples * sizeof(Sample)), "samples");
    fill<<<1024, 256, 0, stream>>>(q, q_elems, seed, 2.0f);
    fill<<<1024, 256, 0, stream>>>(k, kv_elems, seed * 7u + 1u, 2.0f);
    fill<<<1024, 256, 0, stream>>>(v, kv_elems, seed * 3u + 2u, 1.0f);
    // Random rows, and the last rows of a head (they see the last key tile
    // under either mask).
    std::vector<Sample> samples(kSamples);
    std::mt19937 rng(seed);
    for (int i = 0; i < kSamples; ++i)
      samples[i] = {int(rng() % s.b), int(rng() % s.hq), i < 8 ? s.s - 1 - i : int(rng() % s.s)};
    check(cudaMemcpy(samples_d, samples.data(), kSamples * sizeof(Sample), cudaMemcpyHostToDevice), "samples");
    const float scale = 1.0f / std::sqrt(float(s.d));
    reference<<<kSamples, 128, 0, stream>>>(q, k, v, s, scale, samples_d, scores, ref, ref_lse);
    std::vector<float> ref_h(size_t(kSamples) * s.d), ref_lse_h(kSamples), got_h(ref_h.size()),
        got_lse_h(kSamples);
    check(cudaMemcpyAsync(ref_h.data(), ref, ref_h.size() * 4, cudaMemcpyDeviceToHost, stream), "ref");
    check(cudaMemcpyAsync(ref_lse_h.data(), ref_lse, kSamples * 4, cudaMemcpyDeviceToHost, stream), "ref");
    check(cudaStreamSynchronize(stream), "reference");

    pk::ring_attention::Params p;
    p.q = q; p.k = k; p.v = v; p.lse = lse;
    p.batch = s.b; p.q_heads = s.hq; p.kv_heads = s.hkv; p.head_dim = s.d;
    p.dtype = pk::DType::kBF16;
    p.scale = scale;
    p.geo = pk::ring_attention::Geometry{0, 1, s.s, false, s.causal != 0};
    p.ch.flags[0] = flags;
    p.ch.wait = pk::WaitContext{nullptr, claim, uint64_t(10) * 1000000000, 0, 0};
    p.ch.rank = 0;
    p.ch.n = 1;
    p.sm_count = prop.multiProcessorCount;
    p.stream = stream;
    char label[96];
    std::snprintf(label, sizeof(label), "%d, %d, %d/%d, %d, %s", s.b, s.s, s.hq, s.hkv, s.d,
                  s.causal ? "causal" : "full");
    double best_ms = 1e30;
    std::string best_name = "none";
    bool first = true;
    for (const auto& c : configs) {
      if (c.head_dim != s.d || !pk_sweep::selected(c.index)) continue;
      p.out = first ? o0 : o;
      check(cudaMemsetAsync(p.out, 0xFF, q_elems * 2, stream), "poison");  // NaN
      check(cudaMemsetAsync(lse, 0xFF, rows * 4, stream), "poison");
      cudaError_t e = c.run(p);
      if (e != cudaSuccess) {
        std::printf("| %s | %s | - | - | not run: %s |\n", label, c.name, cudaGetErrorString(e));
        continue;
      }
      gather<<<kSamples, 128, 0, stream>>>(static_cast<__nv_bfloat16*>(p.out), lse, s, samples_d,
                                          got, got_lse);
      check(cudaMemcpyAsync(got_h.data(), got, got_h.size() * 4, cudaMemcpyDeviceToHost, stream), "got");
      check(cudaMemcpyAsync(got_lse_h.data(), got_lse, kSamples * 4, cudaMemcpyDeviceToHost, stream), "got");
      float vs0 = 0.f;
      enqueue_vs_first(o, o0, q_elems, !first, diff, &vs0, stream);
      check(cudaStreamSynchronize(stream), "check");
      // Output rows are averages of V rows (|v| < 1): bf16 P and output
      // round at 2^-9 relative; the log-sum-exp is fp32.
      float worst = 0.f, worst_lse = 0.f;
      for (size_t i = 0; i < ref_h.size(); ++i) {
        const float err = std::fabs(got_h[i] - ref_h[i]);
        worst = std::isfinite(err) ? std::fmax(worst, err) : INFINITY;  // NaN: poison left
      }
      for (int i = 0; i < kSamples; ++i) {
        const float err = std::fabs(got_lse_h[i] - ref_lse_h[i]) / std::fmax(1.f, std::fabs(ref_lse_h[i]));
        worst_lse = std::isfinite(err) ? std::fmax(worst_lse, err) : INFINITY;
      }
      const bool ok = worst < 1e-2f && worst_lse < 1e-4f && std::isfinite(vs0) && vs0 < 1e-2f;
      first = false;
      for (int i = 0; i < kWarmup; ++i) check(c.run(p), "warmup");
      check(cudaEventRecord(t0, stream), "record");
      for (int i = 0; i < kIters; ++i) check(c.run(p), "run");
      check(cudaEventRecord(t1, stream), "record");
      check(cudaEventSynchronize(t1), "sync");
      float ms = 0.f;
      check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
      ms /= kIters;
      std::printf("| %s | %s | %.3f | %.0f | %s (out %.1e, lse %.1e, vs first %.1e) |\n", label,
                  c.name, ms, flops(s) / (ms * 1e-3) / 1e12, ok ? "ok" : "WRONG", worst,
                  worst_lse, vs0);
      std::fflush(stdout);
      if (ok && ms < best_ms) best_ms = ms, best_name = c.name;
    }
    char line[256];
    std::snprintf(line, sizeof(line), "best %s: %s, %.3f ms, %.0f TFLOP/s\n", label,
                  best_name.c_str(), best_ms, flops(s) / (best_ms * 1e-3) / 1e12);
    best += line;
    free_all(q, k, v, o, o0, lse, scores, ref, got, ref_lse, got_lse, diff, samples_d);
  }
  std::printf("%s", best.c_str());
  check(cudaFree(flags), "free");
  check(cudaFree(claim), "free");
  return 0;
}
