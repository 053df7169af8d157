// FP8 quantization kernels (fp8.h).
//
// Launch config: kRows: one warp per 1x128 segment, 8 warps per block.
// The others: one block of 256 threads per 128x128 tile (a grid-stride loop
// over the tiles), the tile staged in dynamic shared memory in the input type
// so the transposed copy is written coalesced; kTensor without a given scale
// first runs an amax reduction (grid-stride, one atomic per block).
// Arguments: fp8.h's Quantize. Roles: every thread loads, reduces and
// converts. Entry point: pk::fp8::launch.
#include "kernels/fp8/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "pk/cuda_check.h"

namespace pk::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kPad = 8;  // elements of padding per staged row (bank spread)

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

// x * scale in fp32, converted with saturation to the format's largest
// finite value (NaN stays NaN).
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t convert(float v, float scale) {
  return __nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, kFormat);
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

__global__ void amax_kernel(const void* x, DType in, int64_t count, float* amax) {
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    float v;
    if (in == DType::kBF16) v = __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
    else if (in == DType::kF16) v = __half2float(static_cast<const __half*>(x)[i]);
    else v = static_cast<const float*>(x)[i];
    m = max_nan(m, fabsf(v));
  }
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) atomic_max_abs(amax, m);
}

// kRows: warp w of the grid quantizes segment (row, seg) = (w / segs, w % segs).
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void rows_kernel(Quantize p, float fp8_max) {
  const int64_t segs = (p.cols + kBlock - 1) / kBlock;
  const int64_t total = p.rows * segs;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const T* x = static_cast<const T*>(p.x);
  uint8_t* q = static_cast<uint8_t*>(p.q);
  for (int64_t w = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; w < total;
       w += warps) {
    const int64_t row = w / segs, seg = w % segs;
    const int64_t c0 = seg * kBlock + lane * 4;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v[j] = c0 + j < p.cols ? to_float(x[row * p.cols + c0 + j]) : 0.0f;
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) m = max_nan(m, fabsf(v[j]));
    m = warp_max(m);
    const float scale = scale_of(m, fp8_max);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (c0 + j < p.cols) q[row * p.cols + c0 + j] = convert<kFormat>(v[j], scale);
    if (lane == 0) p.factors[seg * p.rows + row] = 1.0f / scale;
  }
}

// kTensor, kCols, kBlocks: one 128x128 tile per block iteration.
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) tile_kernel(Quantize p, float fp8_max) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);          // [kBlock][kBlock + kPad]
  __shared__ float col_scale[kBlock];
  __shared__ float warp_amax[kThreads / 32];
  constexpr int kStride = kBlock + kPad;
  const int64_t tiles_r = (p.rows + kBlock - 1) / kBlock, tiles_c = (p.cols + kBlock - 1) / kBlock;
  const T* x = static_cast<const T*>(p.x);
  uint8_t* q = static_cast<uint8_t*>(p.q);
  uint8_t* qt = static_cast<uint8_t*>(p.qt);
  const int t = threadIdx.x;
  float tensor_scale = 0.0f;
  if (p.granularity == Granularity::kTensor)
    tensor_scale = p.scale ? *p.scale : scale_of(*p.amax, fp8_max * exp2f(-p.margin));
  if (p.granularity == Granularity::kTensor && blockIdx.x == 0 && t == 0)
    p.factors[0] = 1.0f / tensor_scale;

  for (int64_t tile_id = blockIdx.x; tile_id < tiles_r * tiles_c; tile_id += gridDim.x) {
    const int64_t r0 = (tile_id / tiles_c) * kBlock, c0 = (tile_id % tiles_c) * kBlock;
    const int nr = int(p.rows - r0 < kBlock ? p.rows - r0 : kBlock);
    const int nc = int(p.cols - c0 < kBlock ? p.cols - c0 : kBlock);
    // Stage the tile (zeros outside the matrix), tracking |x|'s max.
    float m = 0.0f;
    for (int i = t; i < kBlock * kBlock; i += kThreads) {
      const int r = i / kBlock, c = i % kBlock;
      T v = T(0.0f);
      if (r < nr && c < nc) v = x[(r0 + r) * p.cols + c0 + c];
      tile[r * kStride + c] = v;
      m = max_nan(m, fabsf(to_float(v)));
    }
    m = warp_max(m);
    if ((t & 31) == 0) warp_amax[t / 32] = m;
    __syncthreads();
    float tile_amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) tile_amax = max_nan(tile_amax, warp_amax[w]);
    if (p.granularity == Granularity::kTensor && p.scale && t == 0 && p.amax)
      atomic_max_abs(p.amax, tile_amax);
    if (p.granularity == Granularity::kCols && t < kBlock) {
      float cm = 0.0f;
      for (int r = 0; r < nr; ++r) cm = max_nan(cm, fabsf(to_float(tile[r * kStride + t])));
      const float s = scale_of(cm, fp8_max);
      col_scale[t] = s;
      if (t < nc) p.factors[(r0 / kBlock) * p.cols + c0 + t] = 1.0f / s;
    }
    const float block_scale = p.granularity == Granularity::kTensor ? tensor_scale
                                                                    : scale_of(tile_amax, fp8_max);
    if (p.granularity == Granularity::kBlocks && t == 0)
      p.factors[(r0 / kBlock) * tiles_c + c0 / kBlock] = 1.0f / block_scale;
    __syncthreads();
    if (q) {  // row-wise copy: consecutive threads along a row
      for (int i = t; i < kBlock * kBlock; i += kThreads) {
        const int r = i / kBlock, c = i % kBlock;
        if (r < nr && c < nc)
          q[(r0 + r) * p.cols + c0 + c] = convert<kFormat>(to_float(tile[r * kStride + c]), block_scale);
      }
    }
    if (qt) {  // transposed copy: consecutive threads along a column of x
      for (int i = t; i < kBlock * kBlock; i += kThreads) {
        const int c = i / kBlock, r = i % kBlock;
        if (r < nr && c < nc) {
          const float s = p.granularity == Granularity::kCols ? col_scale[c] : block_scale;
          qt[(c0 + c) * p.rows + r0 + r] = convert<kFormat>(to_float(tile[r * kStride + c]), s);
        }
      }
    }
    __syncthreads();  // the tile and col_scale are rewritten next iteration
  }
}

template <typename T>
size_t tile_smem() {
  return size_t(kBlock) * (kBlock + kPad) * sizeof(T);
}

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
      amax_kernel<<<grid_for(p.rows * p.cols, kThreads * 8), kThreads, 0, stream>>>(
          p.x, p.in, p.rows * p.cols, p.amax);
      PK_CUDA_TRY(cudaGetLastError());
    }
  }
  const int64_t tiles = ((p.rows + kBlock - 1) / kBlock) * ((p.cols + kBlock - 1) / kBlock);
  tile_kernel<T, kFormat><<<grid_for(tiles, 1), kThreads, tile_smem<T>(), stream>>>(p, fp8_max);
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
  const void* tile = reinterpret_cast<const void*>(tile_kernel<T, kFormat>);
  PK_CUDA_TRY(preload_kernel(tile));
  return cudaFuncSetAttribute(tile, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(tile_smem<T>()));
}

template <typename T>
cudaError_t load_in() {
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
