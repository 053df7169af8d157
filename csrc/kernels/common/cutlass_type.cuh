// The CUTLASS element type of each pk::DType (the instantiations' template
// arguments).
#pragma once

#include <cutlass/numeric_types.h>

#include "kernels/common/dtype.h"

namespace pk {

template <DType>
struct CutlassType;
template <>
struct CutlassType<DType::kBF16> {
  using Type = cutlass::bfloat16_t;
};
template <>
struct CutlassType<DType::kF16> {
  using Type = cutlass::half_t;
};
template <>
struct CutlassType<DType::kF32> {
  using Type = float;
};
template <>
struct CutlassType<DType::kE4M3> {
  using Type = cutlass::float_e4m3_t;
};
template <>
struct CutlassType<DType::kE5M2> {
  using Type = cutlass::float_e5m2_t;
};

}  // namespace pk
