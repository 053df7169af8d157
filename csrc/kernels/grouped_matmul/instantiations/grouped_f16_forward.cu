// Instantiation: f16, forward.
#include "kernels/grouped_matmul/grouped_matmul_sm90.cuh"

template struct pk::grouped_matmul::Variant<pk::DType::kF16, pk::grouped_matmul::Kind::kForward>;
