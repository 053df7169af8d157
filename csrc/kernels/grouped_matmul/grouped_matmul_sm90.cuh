// The sm90 grouped GEMM: CUTLASS's pointer-array TMA warp-specialized
// cooperative kernel over G problems whose shapes and pointers a setup
// kernel writes into scratch memory from the device-side group sizes (the
// kernel rewrites its TMA descriptors per group), instantiated once per
// (type, kind, output type) in grouped_<type>_<kind>[_f32].cu (grouped_matmul.h: Variant).
//
// Launch config: a zero kernel (the rows or groups no GEMM writes), a setup
// kernel (one thread per group), then CUTLASS's persistent grid (one CTA per
// SM, 2x1 clusters, 128x256x64 tiles, two consumer warpgroups).
// Arguments: grouped_matmul.h's Params.
// Roles: setup: group g's offset, size, pointers and strides; grouped GEMM:
// one producer warpgroup (TMA loads), two consumer warpgroups (wgmma,
// epilogue).
// Entry point: Variant<type, kind, fp32 output>::launch.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <type_traits>

#include "kernels/common/cutlass_type.cuh"
#include "kernels/grouped_matmul/grouped_matmul.h"
#include "pk/cuda_check.h"

namespace pk::grouped_matmul {

// Group g's rows [offset, offset + size).
struct GroupRows {
  int64_t offset, size;
};

// Every group's rows [offset[g], offset[g] + size[g]) after the clamps of
// grouped_matmul.h, into shared memory by thread 0 (G <= kMaxGroups: a few
// microseconds at most), then a barrier.
__device__ inline void group_rows(const int32_t* sizes, int groups, int64_t rows,
                                  int64_t* offset, int64_t* size) {
  if (threadIdx.x == 0) {
    int64_t at = 0;
    for (int g = 0; g < groups; ++g) {
      const int64_t want = sizes[g] > 0 ? sizes[g] : 0;
      offset[g] = at;
      size[g] = want < rows - at ? want : rows - at;
      at += size[g];
    }
  }
  __syncthreads();
}

// The layouts of one kind (CUTLASS's A [M, K], B [K, N], D [M, N] of a group).
template <Kind kKind>
struct KindLayouts {  // kForward: a rows @ b[g]
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct KindLayouts<Kind::kLhsGrad> {  // dout rows @ rhs[g]^T: B^T stored row-major
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct KindLayouts<Kind::kRhsGrad> {  // lhs rows^T @ dout rows: A^T stored row-major
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <class Element, Kind kKind, class Out = Element>
struct GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Row = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignOut = 16 / sizeof(Out);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, Row*, kAlignOut, Out,
      Row*, kAlignOut, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element,
      typename KindLayouts<kKind>::A*, kAlign, Element, typename KindLayouts<kKind>::B*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arrays in scratch, each 256-byte aligned.
  struct Arrays {
    Shape* shapes;
    const Element** a;
    const Element** b;
    Out** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    char* end;
  };
  static Arrays arrays(void* scratch, int groups) {
    char* p = static_cast<char*>(scratch);
    auto take = [&](size_t bytes) {
      char* here = p;
      p += (bytes + 255) / 256 * 256;
      return here;
    };
    Arrays r;
    r.shapes = reinterpret_cast<Shape*>(take(sizeof(Shape) * groups));
    r.a = reinterpret_cast<const Element**>(take(sizeof(void*) * groups));
    r.b = reinterpret_cast<const Element**>(take(sizeof(void*) * groups));
    r.d = reinterpret_cast<Out**>(take(sizeof(void*) * groups));
    r.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * groups));
    r.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * groups));
    r.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * groups));
    r.end = p;
    return r;
  }
  static_assert(sizeof(Shape) + 3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) +
                        sizeof(StrideD) <= kPerGroupScratch / 2,
                "per-group arrays outgrow kPerGroupScratch (with 256-byte padding)");

  static typename Adapter::Arguments arguments(const Params& p, const Arrays& arr) {
    typename Adapter::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {p.groups, arr.shapes, nullptr};
    args.mainloop = {arr.a, arr.stride_a, arr.b, arr.stride_b};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = arr.d;
    args.epilogue.dD = arr.stride_d;
    args.hw_info = cutlass::KernelHardwareInfo{p.ordinal, p.sm_count};
    return args;
  }
};

// One block; one thread per group: its problem, pointers and strides
// (grouped_matmul.h's kinds); an empty group gets no tiles.
template <class Element, Kind kKind, class Out>
__global__ void __launch_bounds__(256)
    setup_groups(const int32_t* sizes, int groups, int64_t rows, int64_t k, int64_t n,
                 typename GroupedGemm<Element, kKind, Out>::Arrays arr, const Element* a,
                 const Element* b, Out* out) {
  using G = GroupedGemm<Element, kKind, Out>;
  extern __shared__ int64_t setup_smem[];  // [2 * groups]: offsets, sizes
  group_rows(sizes, groups, rows, setup_smem, setup_smem + groups);
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const GroupRows r{setup_smem[g], setup_smem[groups + g]};
    const int m = int(r.size);
    if constexpr (kKind != Kind::kRhsGrad) {
      // kForward [m, K] @ [K, N], kLhsGrad [m, N] @ [N, K] (rhs read transposed):
      // rows of in_w elements times group g's matrix, into rows of out_w.
      const int in_w = int(kKind == Kind::kForward ? k : n);
      const int out_w = int(kKind == Kind::kForward ? n : k);
      arr.shapes[g] = {m, out_w, in_w};
      arr.a[g] = a + r.offset * in_w;
      arr.b[g] = b + int64_t(g) * k * n;
      arr.d[g] = out + r.offset * out_w;
      arr.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, in_w, 1});
      arr.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {out_w, in_w, 1});
      arr.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, out_w, 1});
    } else {  // [K, m] @ [m, N]; no tiles when m = 0 (the zero kernel writes that group)
      arr.shapes[g] = m > 0 ? typename G::Shape{int(k), int(n), m} : typename G::Shape{0, 0, 0};
      arr.a[g] = a + r.offset * k;
      arr.b[g] = b + r.offset * n;
      arr.d[g] = out + int64_t(g) * k * n;
      arr.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {int(k), m, 1});
      arr.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {int(n), m, 1});
      arr.stride_d[g] =
          cutlass::make_cute_packed_stride(typename G::StrideD{}, {int(k), int(n), 1});
    }
  }
}

// Zeros where no GEMM writes: rows past the groups' sum (kForward,
// kLhsGrad: `width` elements per row) or the groups with no rows (kRhsGrad:
// K * N elements per group). The group sizes are read into shared memory.
template <class Out, Kind kKind>
__global__ void __launch_bounds__(256)
    zero_unwritten(const int32_t* sizes, int groups, int64_t rows, int64_t width, Out* out) {
  extern __shared__ int64_t zero_smem[];  // [2 * groups]: offsets, sizes
  group_rows(sizes, groups, rows, zero_smem, zero_smem + groups);
  const int64_t* clamped = zero_smem + groups;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kKind == Kind::kRhsGrad) {
    for (int g = 0; g < groups; ++g) {
      if (clamped[g] != 0) continue;
      Out* dst = out + int64_t(g) * width;
      for (int64_t i = first; i < width; i += stride) dst[i] = Out(0);
    }
  } else {
    int64_t used = 0;
    for (int g = 0; g < groups; ++g) used += clamped[g];
    for (int64_t i = used * width + first; i < rows * width; i += stride) out[i] = Out(0);
  }
}

template <class Element, Kind kKind, class Out>
struct GroupedRun {
  using G = GroupedGemm<Element, kKind, Out>;

  static typename G::Arrays arrays(const Params& p) { return G::arrays(p.scratch, p.groups); }

  static cudaError_t check(const Params& p) {
    const auto arr = arrays(p);
    const auto args = G::arguments(p, arr);
    const size_t used = size_t(arr.end - static_cast<char*>(p.scratch));
    if (used + G::Adapter::get_workspace_size(args) > p.scratch_bytes) return cudaErrorInvalidValue;
    if (G::Adapter::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    return cudaSuccess;
  }

  static cudaError_t launch(const Params& p) {
    PK_CUDA_TRY(check(p));
    const auto arr = arrays(p);
    auto* a = static_cast<const Element*>(p.a);
    auto* b = static_cast<const Element*>(p.b);
    auto* out = static_cast<Out*>(p.out);
    const int64_t width = kKind == Kind::kForward ? p.n : kKind == Kind::kLhsGrad ? p.k : p.k * p.n;
    const size_t smem = 2 * sizeof(int64_t) * size_t(p.groups);
    zero_unwritten<Out, kKind><<<2 * p.sm_count, 256, smem, p.stream>>>(
        p.group_sizes, p.groups, p.rows, width, out);
    PK_CUDA_TRY(cudaGetLastError());
    setup_groups<Element, kKind, Out><<<1, 256, smem, p.stream>>>(
        p.group_sizes, p.groups, p.rows, p.k, p.n, arr, a, b, out);
    PK_CUDA_TRY(cudaGetLastError());
    typename G::Adapter gemm;
    const auto args = G::arguments(p, arr);
    if (gemm.initialize(args, arr.end, p.stream) != cutlass::Status::kSuccess)
      return cudaErrorInvalidValue;
    if (gemm.run(p.stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }

  static cudaError_t load() {
    auto as_ptr = [](auto* kernel) { return reinterpret_cast<const void*>(kernel); };
    PK_CUDA_TRY(preload_kernel(as_ptr(&setup_groups<Element, kKind, Out>)));
    PK_CUDA_TRY(preload_kernel(as_ptr(&zero_unwritten<Out, kKind>)));
    return preload_kernel(as_ptr(&cutlass::device_kernel<typename G::Kernel>));
  }
};

template <DType kType, Kind kKind, bool kF32Out>
using VariantRun =
    GroupedRun<typename CutlassType<kType>::Type, kKind,
               std::conditional_t<kF32Out, float, typename CutlassType<kType>::Type>>;

template <DType kType, Kind kKind, bool kF32Out>
cudaError_t Variant<kType, kKind, kF32Out>::check(const Params& p) {
  return VariantRun<kType, kKind, kF32Out>::check(p);
}

template <DType kType, Kind kKind, bool kF32Out>
cudaError_t Variant<kType, kKind, kF32Out>::launch(const Params& p) {
  return VariantRun<kType, kKind, kF32Out>::launch(p);
}

template <DType kType, Kind kKind, bool kF32Out>
cudaError_t Variant<kType, kKind, kF32Out>::load() {
  return VariantRun<kType, kKind, kF32Out>::load();
}

}  // namespace pk::grouped_matmul
