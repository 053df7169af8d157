// The element types the kernels take, one enum for every kernel family (each
// family takes a subset: the attention kernels bf16 and fp16, the GEMM fp32
// outputs too).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pk {

enum class DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Bytes per element.
inline size_t itemsize(DType t) { return t == DType::kF32 ? 4 : 2; }

}  // namespace pk
