// FP8 quantization kernels (fp8.h).
//
// Launch config: kRows: one warp per 1x128 segment (4 elements a lane), 8
// warps per block. The others: one block of 256 threads per 128x128 tile (a
// grid-stride loop over the tiles), each thread an 8x8 piece of it held in
// registers: rows read as 8-element vectors (a thread's 8 rows, the half-warp
// beside it the next 8 columns: every 32-byte sector read whole), the
// row-wise copy written 8 bytes a row and the transposed copy 8 bytes a column
// (a half-warp's 16 pieces stacked down the tile: 128 contiguous bytes of a
// transposed row). kTensor without a given scale first runs an amax reduction
// (grid-stride over 8-element vectors, one atomic per warp). Matrices whose
// rows or columns are not multiples of 8, or whose buffers are not aligned to
// the vectors, take scalar accesses with bounds.
// Arguments: fp8.h's Quantize. Roles: every thread loads, reduces and
// converts. Entry point: pk::fp8::launch.
#include "kernels/fp8/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "pk/cuda_check.h"

namespace pk::fp8 {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kPiece = 8;                 // a thread's piece of a tile: 8 rows x 8 columns
constexpr int kPieces = kBlock / kPiece;  // pieces along each side of a tile
static_assert(kPieces * kPieces == kThreads, "one piece per thread");
constexpr int kLane = 4;                  // kRows: elements of a segment per lane

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

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* at, float (&v)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(at);
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_float(pk.v[j]);
}

// x * scale in fp32, converted with saturation to the format's largest
// finite value (NaN stays NaN).
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t convert(float v, float scale) {
  return __nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, kFormat);
}

template <__nv_fp8_interpretation_t kFormat, int N>
__device__ __forceinline__ void store_vec(uint8_t* at, const float (&v)[N], float scale) {
  Pack<uint8_t, N> pk;
#pragma unroll
  for (int j = 0; j < N; ++j) pk.v[j] = convert<kFormat>(v[j], scale);
  *reinterpret_cast<Pack<uint8_t, N>*>(at) = pk;
}

// Non-negative floats order like their bit patterns (NaN above +Inf), so an
// integer max is a float max that propagates NaN.
__device__ __forceinline__ void atomic_max_abs(float* where, float v) {
  atomicMax(reinterpret_cast<int*>(where), __float_as_int(v));
}

__device__ __forceinline__ float max_nan(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// fp8_max / amax, 1 for an all-zero block; non-finite amax gives a
// non-finite or zero scale (NaN/Inf propagate to the factor).
__device__ __forceinline__ float scale_of(float amax, float fp8_max) {
  return amax == 0.0f ? 1.0f : fp8_max / amax;
}

__device__ __forceinline__ bool aligned(const void* at, int bytes) {
  return reinterpret_cast<uintptr_t>(at) % bytes == 0;
}

// ---- roles -----------------------------------------------------------------
// amax(|x|): 8-element vectors grid-strided (x 16-byte aligned), the rest scalar.
template <typename T>
__global__ void amax_kernel(const T* x, int64_t count, float* amax) {
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t vectors = aligned(x, 8 * sizeof(T)) ? count / 8 : 0;
  for (int64_t i = first; i < vectors; i += stride) {
    float v[8];
    load_vec<T, 8>(x + 8 * i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max_nan(m, fabsf(v[j]));
  }
  for (int64_t i = vectors * 8 + first; i < count; i += stride)
    m = max_nan(m, fabsf(to_float(x[i])));
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) atomic_max_abs(amax, m);
}

// kRows: warp w of the grid quantizes segment (row, seg) = (w / segs, w % segs),
// kLane elements a lane (one access each way where cols % kLane == 0).
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void rows_kernel(Quantize p, float fp8_max) {
  const int64_t segs = (p.cols + kBlock - 1) / kBlock;
  const int64_t total = p.rows * segs;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const T* x = static_cast<const T*>(p.x);
  uint8_t* q = static_cast<uint8_t*>(p.q);
  const bool vec = p.cols % kLane == 0 && aligned(x, kLane * sizeof(T)) && aligned(q, kLane);
  for (int64_t w = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; w < total;
       w += warps) {
    const int64_t row = w / segs, seg = w % segs;
    const int64_t c0 = seg * kBlock + lane * kLane;
    const int64_t at = row * p.cols + c0;
    float v[kLane] = {};
    if (vec && c0 < p.cols) {
      load_vec<T, kLane>(x + at, v);
    } else if (!vec) {
#pragma unroll
      for (int j = 0; j < kLane; ++j) v[j] = c0 + j < p.cols ? to_float(x[at + j]) : 0.0f;
    }
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kLane; ++j) m = max_nan(m, fabsf(v[j]));
    m = warp_max(m);
    const float scale = scale_of(m, fp8_max);
    if (vec && c0 < p.cols) {
      store_vec<kFormat, kLane>(q + at, v, scale);
    } else if (!vec) {
#pragma unroll
      for (int j = 0; j < kLane; ++j)
        if (c0 + j < p.cols) q[at + j] = convert<kFormat>(v[j], scale);
    }
    if (lane == 0) p.factors[seg * p.rows + row] = 1.0f / scale;
  }
}

// kTensor, kCols, kBlocks: one 128x128 tile per block iteration; thread t
// holds the 8x8 piece at piece row t % 16, piece column t / 16.
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) tile_kernel(Quantize p, float fp8_max) {
  __shared__ float warp_amax[kThreads / 32];
  const int64_t tiles_r = (p.rows + kBlock - 1) / kBlock, tiles_c = (p.cols + kBlock - 1) / kBlock;
  const T* x = static_cast<const T*>(p.x);
  uint8_t* q = static_cast<uint8_t*>(p.q);
  uint8_t* qt = static_cast<uint8_t*>(p.qt);
  const int t = threadIdx.x;
  const int pr = t % kPieces, pc = t / kPieces;
  // whole pieces, aligned rows of x, q and qt: vector accesses
  const bool vec = p.rows % kPiece == 0 && p.cols % kPiece == 0 &&
                   aligned(x, kPiece * sizeof(T)) && aligned(q, kPiece) && aligned(qt, kPiece);
  const bool cols = p.granularity == Granularity::kCols;
  float tensor_scale = 0.0f;
  if (p.granularity == Granularity::kTensor)
    tensor_scale = p.scale ? *p.scale : scale_of(*p.amax, fp8_max * exp2f(-p.margin));
  if (p.granularity == Granularity::kTensor && blockIdx.x == 0 && t == 0)
    p.factors[0] = 1.0f / tensor_scale;

  for (int64_t tile_id = blockIdx.x; tile_id < tiles_r * tiles_c; tile_id += gridDim.x) {
    const int64_t r0 = (tile_id / tiles_c) * kBlock + pr * kPiece;  // this piece's corner
    const int64_t c0 = (tile_id % tiles_c) * kBlock + pc * kPiece;
    const bool whole = vec && r0 < p.rows && c0 < p.cols;
    // The piece (zeros outside the matrix), |x|'s max per column of it.
    float v[kPiece][kPiece];
    float col_max[kPiece] = {};
#pragma unroll
    for (int i = 0; i < kPiece; ++i) {
      if (whole) {
        load_vec<T, kPiece>(x + (r0 + i) * p.cols + c0, v[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kPiece; ++j)
          v[i][j] = !vec && r0 + i < p.rows && c0 + j < p.cols
                        ? to_float(x[(r0 + i) * p.cols + c0 + j]) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kPiece; ++j) col_max[j] = max_nan(col_max[j], fabsf(v[i][j]));
    }
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kPiece; ++j) m = max_nan(m, col_max[j]);
    if (cols) {  // a column's max over the tile: the 16 pieces stacked in a half-warp
#pragma unroll
      for (int j = 0; j < kPiece; ++j)
#pragma unroll
        for (int o = 1; o < kPieces; o <<= 1)
          col_max[j] = max_nan(col_max[j], __shfl_xor_sync(0xffffffffu, col_max[j], o));
    }
    m = warp_max(m);
    if ((t & 31) == 0) warp_amax[t / 32] = m;
    __syncthreads();
    float tile_amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) tile_amax = max_nan(tile_amax, warp_amax[w]);
    if (p.granularity == Granularity::kTensor && p.scale && t == 0 && p.amax)
      atomic_max_abs(p.amax, tile_amax);
    const float block_scale = p.granularity == Granularity::kTensor ? tensor_scale
                                                                    : scale_of(tile_amax, fp8_max);
    if (p.granularity == Granularity::kBlocks && t == 0)
      p.factors[(r0 / kBlock) * tiles_c + c0 / kBlock] = 1.0f / block_scale;
    float scale[kPiece];
#pragma unroll
    for (int j = 0; j < kPiece; ++j) scale[j] = cols ? scale_of(col_max[j], fp8_max) : block_scale;
    if (cols && pr == 0) {
#pragma unroll
      for (int j = 0; j < kPiece; ++j)
        if (c0 + j < p.cols) p.factors[(r0 / kBlock) * p.cols + c0 + j] = 1.0f / scale[j];
    }
    if (q) {  // row-wise copy: 8 bytes of each of the piece's rows
#pragma unroll
      for (int i = 0; i < kPiece; ++i) {
        if (whole) {
          store_vec<kFormat, kPiece>(q + (r0 + i) * p.cols + c0, v[i], block_scale);
        } else if (!vec) {
#pragma unroll
          for (int j = 0; j < kPiece; ++j)
            if (r0 + i < p.rows && c0 + j < p.cols)
              q[(r0 + i) * p.cols + c0 + j] = convert<kFormat>(v[i][j], block_scale);
        }
      }
    }
    if (qt) {  // transposed copy: 8 bytes of each of the piece's columns
#pragma unroll
      for (int j = 0; j < kPiece; ++j) {
        float col[kPiece];
#pragma unroll
        for (int i = 0; i < kPiece; ++i) col[i] = v[i][j];
        if (whole) {
          store_vec<kFormat, kPiece>(qt + (c0 + j) * p.rows + r0, col, scale[j]);
        } else if (!vec) {
#pragma unroll
          for (int i = 0; i < kPiece; ++i)
            if (r0 + i < p.rows && c0 + j < p.cols)
              qt[(c0 + j) * p.rows + r0 + i] = convert<kFormat>(col[i], scale[j]);
        }
      }
    }
    __syncthreads();  // warp_amax is rewritten next iteration
  }
}

// ---- entry point -----------------------------------------------------------
int grid_for(int64_t work, int per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return int(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

template <typename T, __nv_fp8_interpretation_t kFormat>
cudaError_t launch_typed(const Quantize& p, cudaStream_t stream) {
  const float fp8_max = max_finite(p.out);
  if (p.granularity == Granularity::kRows) {
    const int64_t segs = (p.cols + kBlock - 1) / kBlock;
    rows_kernel<T, kFormat><<<grid_for(p.rows * segs, kThreads / 32), kThreads, 0, stream>>>(p, fp8_max);
    return cudaGetLastError();
  }
  if (p.granularity == Granularity::kTensor) {
    PK_CUDA_TRY(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
    if (!p.scale) {
      amax_kernel<T><<<grid_for(p.rows * p.cols, kThreads * 8), kThreads, 0, stream>>>(
          static_cast<const T*>(p.x), p.rows * p.cols, p.amax);
      PK_CUDA_TRY(cudaGetLastError());
    }
  }
  const int64_t tiles = ((p.rows + kBlock - 1) / kBlock) * ((p.cols + kBlock - 1) / kBlock);
  tile_kernel<T, kFormat><<<grid_for(tiles, 1), kThreads, 0, stream>>>(p, fp8_max);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_in(const Quantize& p, cudaStream_t stream) {
  return p.out == DType::kE4M3 ? launch_typed<T, __NV_E4M3>(p, stream)
                               : launch_typed<T, __NV_E5M2>(p, stream);
}

template <typename T, __nv_fp8_interpretation_t kFormat>
cudaError_t load_typed() {
  PK_CUDA_TRY(preload_kernel(reinterpret_cast<const void*>(rows_kernel<T, kFormat>)));
  return preload_kernel(reinterpret_cast<const void*>(tile_kernel<T, kFormat>));
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
  switch (p.granularity) {
    case Granularity::kTensor: return p.amax && (p.q || p.qt) ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kRows: return p.q && !p.qt ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kCols: return p.qt && !p.q ? cudaSuccess : cudaErrorInvalidValue;
    case Granularity::kBlocks: return p.q || p.qt ? cudaSuccess : cudaErrorInvalidValue;
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch(const Quantize& p, cudaStream_t stream) {
  PK_CUDA_TRY(check(p));
  switch (p.in) {
    case DType::kBF16: return launch_in<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_in<__half>(p, stream);
    default: return launch_in<float>(p, stream);
  }
}

cudaError_t load_kernels() {
  PK_CUDA_TRY(load_in<__nv_bfloat16>());
  PK_CUDA_TRY(load_in<__half>());
  return load_in<float>();
}

}  // namespace pk::fp8
