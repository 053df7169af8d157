// The element types the kernels take, one enum for every kernel family (each
// family takes a subset: the attention kernels bf16 and fp16, the GEMM fp32
// outputs and the two FP8 formats too).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pk {

enum class DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kE4M3 = 3, kE5M2 = 4 };

// Bytes per element.
inline size_t itemsize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kE4M3:
    case DType::kE5M2: return 1;
    default: return 2;
  }
}

inline bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

}  // namespace pk
