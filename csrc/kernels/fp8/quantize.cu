// FP8 quantization kernels (fp8.h).
//
// Launch config: one block of 256 threads per 128x128 tile (a grid-stride loop
// over the tiles), one kernel per granularity, two blocks an SM (128
// registers: at three, 80 registers, they spilled and ran 0.71-0.77x the copy's
// bandwidth against 0.84-0.91x, tools/quantize_bench); kTensor without a given
// scale first runs an amax reduction (grid-stride, four 8-element vectors in
// flight a thread, one atomic per warp).
// Arguments: fp8.h's Quantize.
// Roles: in the tile kernel every thread loads 8 rows x 8 columns of the tile
// (rows lr + 16 i, columns 8 cv..8 cv + 7: a warp reads two whole 128-element
// rows per vector load), keeps them in their input type, reduces the amaxes
// its granularity needs (a row's 16 vectors lie in 16 lanes, a column's in the
// block's 16 threads of one cv), converts, and writes the row-wise copy 8
// bytes a row (a warp writes two whole 128-byte rows). The transposed copy
// goes through shared memory: the converted bytes stored row by row (words
// XOR-swizzled by the row's 16-row group, so the reads below hit 32 banks),
// then each thread reads 16 rows x 4 columns as 16 words, transposes them with
// byte permutes and writes 4 columns of 16 bytes (a warp writes four whole
// 128-byte rows of qt). Matrices whose rows are not multiples of 16 or columns
// of 8, or whose buffers are not aligned to the vectors, take the same roles
// with one element per access and bounds on each.
// Entry point: pk::fp8::run.
#include "kernels/fp8/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "pk/cuda_check.h"

namespace pk::fp8 {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kVec = 8;                    // elements of a thread's vector along a row
constexpr int kVecsPerRow = kBlock / kVec;  // 16: threads sharing a tile row
constexpr int kRowStep = kThreads / kVecsPerRow;  // 16: rows between a thread's rows
constexpr int kRowsPerThread = kBlock / kRowStep;  // 8
constexpr int kWordsPerRow = kBlock / 4;   // 32 words of FP8 bytes per tile row
constexpr int kSegRows = 16;               // transposed copy: rows per thread (16 bytes)
constexpr int kAmaxVecs = 4;               // amax pass: vectors in flight a thread
// The largest scale: 2^126, whose factor 2^-126 is float32's smallest normal
// (a denormal factor would be flushed to zero by some consumers).
constexpr float kMaxScale = 0x1p126f;
constexpr int kMaxGrid = 1 << 20;
static_assert(kRowStep * kRowsPerThread == kBlock && kVecsPerRow * kRowStep == kThreads);
static_assert((kBlock / kSegRows) * (kWordsPerRow / (kThreads / 32)) == 32,
              "transposed copy: a warp covers 8 row segments x 4 column words");

// ---- arguments: fp8.h's Quantize; element access ---------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}

// N elements of T as one access (vector loads and stores).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// max(a, b) that propagates NaN
__device__ __forceinline__ float max_nan(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

// Two elements of T and |x|'s running max over them, in T's own packed
// arithmetic (exact: a max rounds nothing; NaN propagates).
template <typename T> struct PairOf { using type = float2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct PairOf<__half> { using type = __half2; };

__device__ __forceinline__ __nv_bfloat162 abs_max(__nv_bfloat162 m, __nv_bfloat162 v) {
  return __hmax2_nan(m, __habs2(v));
}
__device__ __forceinline__ __half2 abs_max(__half2 m, __half2 v) {
  return __hmax2_nan(m, __habs2(v));
}
__device__ __forceinline__ float2 abs_max(float2 m, float2 v) {
  return make_float2(max_nan(m.x, fabsf(v.x)), max_nan(m.y, fabsf(v.y)));
}
__device__ __forceinline__ float2 as_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 as_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 as_float2(float2 v) { return v; }

__device__ __forceinline__ bool aligned(const void* at, int bytes) {
  return reinterpret_cast<uintptr_t>(at) % bytes == 0;
}

// Non-negative floats order like their bit patterns (NaN above +Inf), so an
// integer max is a float max that propagates NaN.
__device__ __forceinline__ void atomic_max_abs(float* where, float v) {
  atomicMax(reinterpret_cast<int*>(where), __float_as_int(v));
}

// max over the lanes l ^ o for o < kWidth (kWidth a power of two <= 32)
template <int kWidth>
__device__ __forceinline__ float lanes_max(float v) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// fp8_max / amax, 1 for an all-zero block, at most kMaxScale: a block of
// vanishing values (a confident softmax's gradients) would otherwise get an
// infinite scale, and its zeros NaN (0 * inf). A NaN amax gives a NaN scale,
// an infinite one a zero scale (both propagate to the factor).
__device__ __forceinline__ float scale_of(float amax, float fp8_max) {
  const float scale = fp8_max / amax;
  return amax == 0.0f ? 1.0f : scale > kMaxScale ? kMaxScale : scale;
}

// x[j] * scale[j] for 4 values in fp32, converted with saturation to the
// format's largest finite value (NaN stays NaN), x[0] in the low byte.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t convert4(const float* x, const float* scale) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[0] * scale[0], x[1] * scale[1]),
                                               __NV_SATFINITE, kFormat);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[2] * scale[2], x[3] * scale[3]),
                                               __NV_SATFINITE, kFormat);
  return lo | hi << 16;
}

// Shared-memory word of tile row r, word column w (4 columns): the XOR with
// the row's 16-row group keeps a row's word pairs together (8-byte stores) and
// spreads the transposed reads (16-row groups x 4 words) over 32 banks.
__device__ __forceinline__ int smem_word(int r, int w) {
  return r * kWordsPerRow + (w ^ (4 * ((r / kSegRows) & 7)));
}

// ---- roles -----------------------------------------------------------------
// amax(|x|): kAmaxVecs 8-element vectors a thread in flight (x aligned to
// them), grid-strided; the rest scalar.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t count, float* amax) {
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t vectors = aligned(x, kVec * sizeof(T)) ? count / kVec : 0;
  const auto* v = reinterpret_cast<const Pack<T, kVec>*>(x);
  int64_t i = first;
  for (; i + (kAmaxVecs - 1) * stride < vectors; i += kAmaxVecs * stride) {
    Pack<T, kVec> pk[kAmaxVecs];
#pragma unroll
    for (int u = 0; u < kAmaxVecs; ++u) pk[u] = v[i + u * stride];
#pragma unroll
    for (int u = 0; u < kAmaxVecs; ++u)
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = max_nan(m, fabsf(to_float(pk[u].v[j])));
  }
  for (; i < vectors; i += stride) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = max_nan(m, fabsf(to_float(v[i].v[j])));
  }
  for (int64_t e = vectors * kVec + first; e < count; e += stride)
    m = max_nan(m, fabsf(to_float(x[e])));
  m = lanes_max<32>(m);
  if ((threadIdx.x & 31) == 0) atomic_max_abs(amax, m);
}

// The tile kernel's shared memory.
struct TileSmem {
  uint32_t bytes[kBlock * kWordsPerRow];         // the transposed copy's bytes, row-major
  float col_max[kThreads / 32][kBlock];          // kCols: a column's max per warp
  float col_scale[kBlock];                       // kCols: a column's scale
  float warp_max[kThreads / 32];                 // the block's amax per warp
};

// Every granularity: one 128x128 tile per block iteration (roles above).
// kVecIo: rows % 16 == 0, cols % 8 == 0 and the buffers aligned to the vectors.
template <typename T, __nv_fp8_interpretation_t kFormat, Granularity g, bool kVecIo>
__global__ void __launch_bounds__(kThreads, 2) tile_kernel(Quantize p, float fp8_max) {
  // What the granularity computes: q's scales per 1x128 (row_factors) or one
  // per tile; 128x1 column scales for qt (kCols, kRowsCols); the tile's amax
  // (a 128x128 block's factor; per-tensor scaling's running amax).
  constexpr bool kRowScales = row_factors(g);
  constexpr bool kColScales = g == Granularity::kCols || g == Granularity::kRowsCols;
  constexpr bool kBlockFactor = g == Granularity::kBlocks || g == Granularity::kRowsBlocks;
  constexpr bool kTileAmax = kBlockFactor || g == Granularity::kTensor;
  __shared__ TileSmem smem;
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t tiles_r = (rows + kBlock - 1) / kBlock, tiles_c = (cols + kBlock - 1) / kBlock;
  const T* x = static_cast<const T*>(p.x);
  uint8_t* q = static_cast<uint8_t*>(p.q);
  uint8_t* qt = static_cast<uint8_t*>(p.qt);
  const int t = threadIdx.x, lane = t & 31, warp = t / 32;
  const int lr = t / kVecsPerRow, cv = t % kVecsPerRow;  // load role
  // transposed-copy role: rows 16 seg .. +15, word column 4 warp + sub (4 columns)
  const int seg = lane % 8, tw = 4 * warp + lane / 8;
  float tensor_scale = 0.0f;
  if constexpr (g == Granularity::kTensor) {
    tensor_scale = p.scale ? *p.scale : scale_of(*p.amax, fp8_max * exp2f(-p.margin));
    if (blockIdx.x == 0 && t == 0) p.factors[0] = 1.0f / tensor_scale;
  }

  for (int64_t tile = blockIdx.x; tile < tiles_r * tiles_c; tile += gridDim.x) {
    const int64_t tr = tile / tiles_c, tc = tile % tiles_c;
    const int64_t r0 = tr * kBlock, c0 = tc * kBlock + cv * kVec;  // c0: this thread's columns
    // Load 8 rows x 8 columns (zeros outside the matrix).
    Pack<T, kVec> v[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t r = r0 + lr + i * kRowStep;
      if constexpr (kVecIo) {
        if (r < rows && c0 < cols)
          v[i] = *reinterpret_cast<const Pack<T, kVec>*>(x + r * cols + c0);
        else
#pragma unroll
          for (int j = 0; j < kVec; ++j) v[i].v[j] = T(0.0f);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          v[i].v[j] = r < rows && c0 + j < cols ? x[r * cols + c0 + j] : T(0.0f);
      }
    }
    // |x|'s max per row (kRows: over the row's 16 threads), per column of the
    // thread's piece (kCols), and over the piece, in packed pairs.
    using Pair = typename PairOf<T>::type;
    constexpr int kPairs = kVec / 2;
    Pair col_max2[kPairs];  // |x| of the first row to begin: abs_max(e, e) = |e|
#pragma unroll
    for (int h = 0; h < kPairs; ++h) {
      const Pair e = reinterpret_cast<const Pair*>(v[0].v)[h];
      col_max2[h] = abs_max(e, e);
    }
    float row_scale[kRowsPerThread], m = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const Pair* e = reinterpret_cast<const Pair*>(v[i].v);
      Pair rm2 = abs_max(e[0], e[0]);
#pragma unroll
      for (int h = 0; h < kPairs; ++h) {
        rm2 = abs_max(rm2, e[h]);
        if constexpr (kColScales) col_max2[h] = abs_max(col_max2[h], e[h]);
      }
      const float2 rf = as_float2(rm2);
      const float rm = max_nan(rf.x, rf.y);
      m = max_nan(m, rm);
      if constexpr (kRowScales) row_scale[i] = scale_of(lanes_max<kVecsPerRow>(rm), fp8_max);
    }
    float col_scale[kVec];
    if constexpr (kColScales) {  // the 16 threads of this cv: lanes cv, cv + 16 of each warp
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float2 cf = as_float2(col_max2[j / 2]);
        float cm = j % 2 ? cf.y : cf.x;
        cm = max_nan(cm, __shfl_xor_sync(0xffffffffu, cm, 16));
        if (lane < kVecsPerRow) smem.col_max[warp][cv * kVec + j] = cm;
      }
    }
    // The tile's amax (block factors; delayed scaling's running amax): over
    // the block through shared memory. Rows and columns need none, and rows
    // no barrier at all (their warps never wait for one another). Columns:
    // 0.65-0.73x a device copy's bandwidth -> 0.78-0.85x (tools/quantize_bench,
    // one H100); rows 0.72-0.80x -> 0.76-0.85x without the row groups' factor
    // index below, 0.73-0.79x with it (cause not established). Per-tensor
    // scaling keeps the reduction also where it reads none (current
    // scaling): a variant that skipped it there (a run-time test of the
    // scale) ran delayed scaling 5-8% slower in the same run.
    float tile_amax = 0.0f;
    if constexpr (kTileAmax) {
      m = lanes_max<32>(m);
      if (lane == 0) smem.warp_max[warp] = m;
    }
    if constexpr (kTileAmax || kColScales) __syncthreads();  // col_max
    if constexpr (kTileAmax) {
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) tile_amax = max_nan(tile_amax, smem.warp_max[w]);
    }
    if constexpr (kColScales) {  // thread t < 128: column t's scale and factor
      if (t < kBlock) {
        float cm = 0.0f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) cm = max_nan(cm, smem.col_max[w][t]);
        const float scale = scale_of(cm, fp8_max);
        smem.col_scale[t] = scale;
        float* col_factors = two_factors(g) ? p.factors_t : p.factors;
        if (tc * kBlock + t < cols) col_factors[tr * cols + tc * kBlock + t] = 1.0f / scale;
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_scale[j] = smem.col_scale[cv * kVec + j];
    }
    if (g == Granularity::kTensor && p.scale && t == 0) atomic_max_abs(p.amax, tile_amax);
    const float block_scale = g == Granularity::kTensor ? tensor_scale
                              : kBlockFactor ? scale_of(tile_amax, fp8_max) : 0.0f;
    // Factors.
    if (kBlockFactor && t == 0)
      (two_factors(g) ? p.factors_t : p.factors)[tr * tiles_c + tc] = 1.0f / block_scale;
    if (kRowScales && cv == 0) {
      const int64_t group_rows = rows / p.row_groups;  // fp8.h: kRows' row groups
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int64_t r = r0 + lr + i * kRowStep;
        if (r >= rows) continue;
        const int64_t at = p.row_groups == 1  // no divisions in the common layout
                               ? tc * rows + r
                               : (r / group_rows) * (tiles_c * group_rows) + tc * group_rows +
                                     r % group_rows;
        p.factors[at] = 1.0f / row_scale[i];
      }
    }
    // Convert: the row-wise copy to global memory, the transposed copy's bytes
    // (the same but for column scales, and kRowsBlocks' tile scale) to shared
    // memory.
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int lrow = lr + i * kRowStep;
      const int64_t r = r0 + lrow;
      float f[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) f[j] = to_float(v[i].v[j]);
      const float s = kRowScales ? row_scale[i] : block_scale;
      const float same[4] = {s, s, s, s};
      uint32_t w[2] = {convert4<kFormat>(f, same), convert4<kFormat>(f + 4, same)};
      if (q && r < rows) {
        if constexpr (kVecIo) {
          if (c0 < cols) *reinterpret_cast<uint2*>(q + r * cols + c0) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            if (c0 + j < cols) q[r * cols + c0 + j] = uint8_t(w[j / 4] >> (8 * (j % 4)));
        }
      }
      if (qt) {
        if constexpr (kColScales) {
          w[0] = convert4<kFormat>(f, col_scale), w[1] = convert4<kFormat>(f + 4, col_scale + 4);
        } else if constexpr (g == Granularity::kRowsBlocks) {
          const float tile[4] = {block_scale, block_scale, block_scale, block_scale};
          w[0] = convert4<kFormat>(f, tile), w[1] = convert4<kFormat>(f + 4, tile);
        }
        *reinterpret_cast<uint2*>(&smem.bytes[smem_word(lrow, 2 * cv)]) = make_uint2(w[0], w[1]);
      }
    }
    if (qt) {
      __syncthreads();
      // 16 rows x 4 columns: words (row, tw) -> 4 columns of 16 bytes.
      uint32_t out[4][4];  // [column][4-row group]
#pragma unroll
      for (int g4 = 0; g4 < kSegRows / 4; ++g4) {
        uint32_t a[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = smem.bytes[smem_word(seg * kSegRows + 4 * g4 + k, tw)];
        const uint32_t lo01 = __byte_perm(a[0], a[1], 0x5140), hi01 = __byte_perm(a[0], a[1], 0x7362);
        const uint32_t lo23 = __byte_perm(a[2], a[3], 0x5140), hi23 = __byte_perm(a[2], a[3], 0x7362);
        out[0][g4] = __byte_perm(lo01, lo23, 0x5410);
        out[1][g4] = __byte_perm(lo01, lo23, 0x7632);
        out[2][g4] = __byte_perm(hi01, hi23, 0x5410);
        out[3][g4] = __byte_perm(hi01, hi23, 0x7632);
      }
      const int64_t rr = r0 + seg * kSegRows;  // qt's column offset
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t c = tc * kBlock + 4 * tw + k;  // qt's row
        if (c >= cols) continue;
        uint8_t* at = qt + c * rows + rr;
        if constexpr (kVecIo) {
          if (rr < rows) *reinterpret_cast<uint4*>(at) = make_uint4(out[k][0], out[k][1], out[k][2], out[k][3]);
        } else {
#pragma unroll
          for (int b = 0; b < kSegRows; ++b)
            if (rr + b < rows) at[b] = uint8_t(out[k][b / 4] >> (8 * (b % 4)));
        }
      }
    }
    if (g != Granularity::kRows) __syncthreads();  // shared memory is rewritten next iteration
  }
}

// ---- entry point -----------------------------------------------------------
using TileKernel = void (*)(Quantize, float);

template <typename T, __nv_fp8_interpretation_t kFormat, bool kVecIo>
TileKernel tile_kernel_of(Granularity g) {
  switch (g) {
    case Granularity::kTensor: return tile_kernel<T, kFormat, Granularity::kTensor, kVecIo>;
    case Granularity::kRows: return tile_kernel<T, kFormat, Granularity::kRows, kVecIo>;
    case Granularity::kCols: return tile_kernel<T, kFormat, Granularity::kCols, kVecIo>;
    case Granularity::kBlocks: return tile_kernel<T, kFormat, Granularity::kBlocks, kVecIo>;
    case Granularity::kRowsCols: return tile_kernel<T, kFormat, Granularity::kRowsCols, kVecIo>;
    default: return tile_kernel<T, kFormat, Granularity::kRowsBlocks, kVecIo>;
  }
}

template <typename T, __nv_fp8_interpretation_t kFormat>
TileKernel tile_kernel_of(Granularity g, bool vec_io) {
  return vec_io ? tile_kernel_of<T, kFormat, true>(g) : tile_kernel_of<T, kFormat, false>(g);
}

int grid_for(int64_t work, int per_block, int cap) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return int(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

template <typename T, __nv_fp8_interpretation_t kFormat>
cudaError_t launch_typed(const Quantize& p) {
  const cudaStream_t stream = p.stream;
  const float fp8_max = max_finite(p.out);
  if (p.granularity == Granularity::kTensor) {
    PK_CUDA_TRY(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
    if (!p.scale) {
      int sms = 0, dev = 0;
      PK_CUDA_TRY(cudaGetDevice(&dev));
      PK_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      amax_kernel<T><<<grid_for(p.rows * p.cols, kThreads * kVec * kAmaxVecs, 8 * sms), kThreads,
                       0, stream>>>(static_cast<const T*>(p.x), p.rows * p.cols, p.amax);
      PK_CUDA_TRY(cudaGetLastError());
    }
  }
  const int64_t tiles = ((p.rows + kBlock - 1) / kBlock) * ((p.cols + kBlock - 1) / kBlock);
  const int grid = grid_for(tiles, 1, kMaxGrid);
  const bool vec_io = p.rows % kSegRows == 0 && p.cols % kVec == 0 &&
                      reinterpret_cast<uintptr_t>(p.x) % (kVec * sizeof(T)) == 0 &&
                      reinterpret_cast<uintptr_t>(p.q) % kVec == 0 &&
                      reinterpret_cast<uintptr_t>(p.qt) % kSegRows == 0;
  tile_kernel_of<T, kFormat>(p.granularity, vec_io)<<<grid, kThreads, 0, stream>>>(p, fp8_max);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_in(const Quantize& p) {
  return p.out == DType::kE4M3 ? launch_typed<T, __NV_E4M3>(p) : launch_typed<T, __NV_E5M2>(p);
}

template <typename T, __nv_fp8_interpretation_t kFormat>
cudaError_t load_typed() {
  for (Granularity g : {Granularity::kTensor, Granularity::kRows, Granularity::kCols,
                        Granularity::kBlocks, Granularity::kRowsCols, Granularity::kRowsBlocks})
    for (bool vec_io : {true, false})
      PK_CUDA_TRY(preload_kernel(reinterpret_cast<const void*>(tile_kernel_of<T, kFormat>(g, vec_io))));
  return cudaSuccess;
}

template <typename T>
cudaError_t load_in() {
  PK_CUDA_TRY(preload_kernel(reinterpret_cast<const void*>(amax_kernel<T>)));
  PK_CUDA_TRY((load_typed<T, __NV_E4M3>()));
  return load_typed<T, __NV_E5M2>();
}

}  // namespace

cudaError_t check(const Quantize& p) {
  const bool in = p.in == DType::kBF16 || p.in == DType::kF16 || p.in == DType::kF32;
  const bool out = p.out == DType::kE4M3 || p.out == DType::kE5M2;
  const int64_t limit = int64_t(1) << 31;
  if (!in || !out || !p.x || !p.factors || p.rows <= 0 || p.cols <= 0 || p.rows >= limit ||
      p.cols >= limit)
    return cudaErrorInvalidValue;
  const bool groups = p.row_groups == 1 || (row_factors(p.granularity) && p.row_groups > 1 &&
                                             p.rows % p.row_groups == 0);
  if (!groups || two_factors(p.granularity) != (p.factors_t != nullptr))
    return cudaErrorInvalidValue;
  switch (p.granularity) {
    case Granularity::kTensor: return p.amax && (p.q || p.qt) ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kRows: return p.q && !p.qt ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kCols: return p.qt && !p.q ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kBlocks: return p.q || p.qt ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kRowsCols:
    case Granularity::kRowsBlocks: return p.q && p.qt ? cudaSuccess : cudaErrorInvalidValue;
  }
  return cudaErrorInvalidValue;
}

cudaError_t run(const Quantize& p) {
  PK_CUDA_TRY(check(p));
  switch (p.in) {
    case DType::kBF16: return launch_in<__nv_bfloat16>(p);
    case DType::kF16: return launch_in<__half>(p);
    default: return launch_in<float>(p);
  }
}

cudaError_t load_kernels() {
  PK_CUDA_TRY(load_in<__nv_bfloat16>());
  PK_CUDA_TRY(load_in<__half>());
  return load_in<float>();
}

}  // namespace pk::fp8
