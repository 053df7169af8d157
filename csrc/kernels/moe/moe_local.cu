// MoE rows on one device (pk_jax.moe_dispatch / moe_combine on an expert
// axis of one GPU): the layout's two row movements as row kernels, a block
// per row (grid-strided), 16-byte accesses where the rows allow them.
//
//   scatter_rows: out[dest[i]] = scale[i] * src[i / repeat] for every slot
//                 i, each src row read once for its `repeat` slots; zeros
//                 on the rows no slot lands on (row_slot < 0): dispatch's
//                 rows from the tokens (the k copies of a token are never
//                 materialized), and combine's input gradient (scale: each
//                 slot's weight).
//   weighted_sum: out[t] = sum_j weight[t, j] * src[index[t, j]] in fp32, j
//                 in order: combine (each token's k rows, no [T * k, H]
//                 intermediate), and dispatch's input gradient (no weights).
// No collective, no channel: the routing arrays are read on the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>

#include "kernels/moe/moe.h"
#include "pk/cuda_check.h"
#include "pk/type_tag.h"

namespace pk::moe {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 128;
constexpr uint64_t kMaxBlocks = 4096;  // rows are grid-strided beyond this
constexpr int kUnroll = 4;             // vectors in flight per thread
constexpr uint64_t kMinItems = 2048;   // work items (row pieces) a call is split into at least

// W elements of T: one 16-byte access when W * sizeof(T) == 16.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

// ---- arguments -------------------------------------------------------------
template <typename T>
struct ScatterArgs {
  const T* __restrict__ src;
  T* __restrict__ out;
  const int32_t* __restrict__ dest;      // [src_rows * repeat] the row of each slot
  const int32_t* __restrict__ row_slot;  // [rows] the slot of each row, < 0: none
  const float* __restrict__ scale;       // [src_rows * repeat], or null
  uint64_t src_rows;
  uint64_t rows;
  uint64_t cols;
  uint64_t repeat;
  uint64_t chunk;  // vectors of a row per work item
};

template <typename T>
struct SumArgs {
  const T* __restrict__ src;
  T* __restrict__ out;
  const int32_t* __restrict__ index;
  const float* __restrict__ weight;
  uint64_t src_rows;
  uint64_t tokens;
  uint64_t k;
  uint64_t cols;
  uint64_t chunk;  // vectors of a row per work item
};

// ---- roles -----------------------------------------------------------------
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> scaled(Pack<T, W> p, float s) {
#pragma unroll
  for (int e = 0; e < W; ++e) p.v[e] = T(s * float(p.v[e]));
  return p;
}

// Vectors [begin, end) of source row t to its slots' rows: kUnroll vectors
// loaded once, stored to each of the `repeat` rows (scaled by the slot's
// factor).
template <typename T, int W>
__device__ __forceinline__ void scatter_row(const ScatterArgs<T>& a, uint64_t t, uint64_t begin,
                                            uint64_t end) {
  using P = Pack<T, W>;
  const uint64_t vecs = a.cols / W;
  const P* in = reinterpret_cast<const P*>(a.src) + t * vecs;
  const uint64_t step = uint64_t(blockDim.x) * kUnroll;
  for (uint64_t v0 = begin + threadIdx.x; v0 < end; v0 += step) {
    P got[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + uint64_t(u) * blockDim.x;
      if (v < end) got[u] = in[v];
    }
    for (uint64_t j = 0; j < a.repeat; ++j) {
      const uint64_t slot = t * a.repeat + j;
      const int64_t row = a.dest[slot];
      if (row < 0 || uint64_t(row) >= a.rows) continue;
      P* out = reinterpret_cast<P*>(a.out) + uint64_t(row) * vecs;
      const float s = a.scale == nullptr ? 1.f : a.scale[slot];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t v = v0 + uint64_t(u) * blockDim.x;
        if (v < end) out[v] = a.scale == nullptr ? got[u] : scaled(got[u], s);
      }
    }
  }
}

// Vectors [begin, end) of output row r when no slot lands on it: zeros.
template <typename T, int W>
__device__ __forceinline__ void zero_unused_row(const ScatterArgs<T>& a, uint64_t r,
                                                uint64_t begin, uint64_t end) {
  using P = Pack<T, W>;
  const int64_t slot = a.row_slot[r];
  if (slot >= 0 && uint64_t(slot) < a.src_rows * a.repeat) return;
  P* out = reinterpret_cast<P*>(a.out) + r * (a.cols / W);
  for (uint64_t v = begin + threadIdx.x; v < end; v += blockDim.x) out[v] = P{};
}

// Vectors [begin, end) of output row t: its k source rows summed in fp32 (j
// in order), weighted; kUnroll rows loaded before any is added.
template <typename T, int W>
__device__ __forceinline__ void sum_row(const SumArgs<T>& a, uint64_t t, uint64_t begin,
                                        uint64_t end) {
  using P = Pack<T, W>;
  const uint64_t vecs = a.cols / W;
  const P* in = reinterpret_cast<const P*>(a.src);
  P* out = reinterpret_cast<P*>(a.out) + t * vecs;
  const int32_t* index = a.index + t * a.k;
  const float* weight = a.weight == nullptr ? nullptr : a.weight + t * a.k;
  for (uint64_t v = begin + threadIdx.x; v < end; v += blockDim.x) {
    float acc[W] = {};
    for (uint64_t j0 = 0; j0 < a.k; j0 += kUnroll) {
      P got[kUnroll];
      bool has[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = j0 + u < a.k ? index[j0 + u] : -1;
        has[u] = row >= 0 && uint64_t(row) < a.src_rows;
        got[u] = has[u] ? in[uint64_t(row) * vecs + v] : P{};
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!has[u]) continue;
        const float w = weight == nullptr ? 1.f : weight[j0 + u];
#pragma unroll
        for (int e = 0; e < W; ++e) acc[e] += w * float(got[u].v[e]);
      }
    }
    P o;
#pragma unroll
    for (int e = 0; e < W; ++e) o.v[e] = T(acc[e]);
    out[v] = o;
  }
}

// ---- entry points ----------------------------------------------------------
// Work items: a chunk of vectors of a row (the chunks of a row are
// consecutive items): the src rows' (pushed), then the output rows' (zeroed
// where unused).
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const __grid_constant__ ScatterArgs<T> a) {
  const uint64_t vecs = a.cols / W;
  const uint64_t chunks = (vecs + a.chunk - 1) / a.chunk;
  for (uint64_t i = blockIdx.x; i < (a.src_rows + a.rows) * chunks; i += gridDim.x) {
    const uint64_t row = i / chunks, begin = (i % chunks) * a.chunk;
    const uint64_t end = begin + a.chunk < vecs ? begin + a.chunk : vecs;
    if (row < a.src_rows)
      scatter_row<T, W>(a, row, begin, end);
    else
      zero_unused_row<T, W>(a, row - a.src_rows, begin, end);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    weighted_sum_kernel(const __grid_constant__ SumArgs<T> a) {
  const uint64_t vecs = a.cols / W;
  const uint64_t chunks = (vecs + a.chunk - 1) / a.chunk;
  for (uint64_t i = blockIdx.x; i < a.tokens * chunks; i += gridDim.x) {
    const uint64_t begin = (i % chunks) * a.chunk;
    sum_row<T, W>(a, i / chunks, begin, begin + a.chunk < vecs ? begin + a.chunk : vecs);
  }
}

// Vectors per work item: whole rows when the rows alone give the grid
// kMinItems items, else rows split (down to kThreads vectors a piece) until
// they do: few-token calls (decode) spread each row over several blocks.
uint64_t chunk_vectors(uint64_t rows, uint64_t vecs) {
  const uint64_t max_chunks = std::max<uint64_t>((vecs + kThreads - 1) / kThreads, 1);
  const uint64_t chunks =
      std::clamp<uint64_t>((kMinItems + rows - 1) / std::max<uint64_t>(rows, 1), 1, max_chunks);
  return std::max<uint64_t>((vecs + chunks - 1) / chunks, 1);
}

int grid(uint64_t items) { return int(std::clamp<uint64_t>(items, 1, kMaxBlocks)); }

// f(TypeTag<T>{}) for the element type.
template <typename F>
cudaError_t with_type(DType t, F&& f) {
  switch (t) {
    case DType::kBF16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kF16:  return f(TypeTag<__half>{});
    case DType::kF32:  return f(TypeTag<float>{});
    default:           return cudaErrorInvalidValue;
  }
}

// 16 bytes of T a vector when every row (and base address) allows it, else one element.
template <typename T>
bool wide(uint64_t cols, const void* a, const void* b) {
  constexpr uint64_t kWide = 16 / sizeof(T);
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  return cols % kWide == 0 && bits % 16 == 0;
}

}  // namespace

cudaError_t run(const ScatterParams& p) {
  if (p.src_rows + p.rows == 0 || p.cols == 0) return cudaSuccess;
  return with_type(p.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kWide = 16 / sizeof(T);
    const bool w = wide<T>(p.cols, p.src, p.out);
    const uint64_t vecs = w ? p.cols / kWide : p.cols;
    const uint64_t chunk = chunk_vectors(p.src_rows, vecs);  // the pushes are the work
    const ScatterArgs<T> a{static_cast<const T*>(p.src), static_cast<T*>(p.out), p.dest,
                           p.row_slot, p.scale, p.src_rows, p.rows, p.cols, p.repeat, chunk};
    const int blocks = grid((p.src_rows + p.rows) * ((vecs + chunk - 1) / chunk));
    if (w)
      scatter_rows_kernel<T, kWide><<<blocks, kThreads, 0, p.stream>>>(a);
    else
      scatter_rows_kernel<T, 1><<<blocks, kThreads, 0, p.stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t run(const SumParams& p) {
  if (p.tokens == 0 || p.cols == 0) return cudaSuccess;
  return with_type(p.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kWide = 16 / sizeof(T);
    const bool w = wide<T>(p.cols, p.src, p.out);
    const uint64_t vecs = w ? p.cols / kWide : p.cols;
    const uint64_t chunk = chunk_vectors(p.tokens, vecs);
    const SumArgs<T> a{static_cast<const T*>(p.src), static_cast<T*>(p.out), p.index, p.weight,
                       p.src_rows, p.tokens, p.k, p.cols, chunk};
    const int blocks = grid(p.tokens * ((vecs + chunk - 1) / chunk));
    if (w)
      weighted_sum_kernel<T, kWide><<<blocks, kThreads, 0, p.stream>>>(a);
    else
      weighted_sum_kernel<T, 1><<<blocks, kThreads, 0, p.stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t load_local_kernels() {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    PK_CUDA_TRY(with_type(t, [](auto tag) {
      using T = typename decltype(tag)::type;
      constexpr int kWide = 16 / sizeof(T);
      const std::array kernels{reinterpret_cast<const void*>(scatter_rows_kernel<T, kWide>),
                               reinterpret_cast<const void*>(scatter_rows_kernel<T, 1>),
                               reinterpret_cast<const void*>(weighted_sum_kernel<T, kWide>),
                               reinterpret_cast<const void*>(weighted_sum_kernel<T, 1>)};
      for (const void* k : kernels) PK_CUDA_TRY(preload_kernel(k));
      return cudaSuccess;
    }));
  }
  return cudaSuccess;
}

}  // namespace pk::moe
