// Instantiation: bf16, forward.
#include "kernels/grouped_matmul/grouped_matmul_sm90.cuh"

template struct pk::grouped_matmul::Variant<pk::DType::kBF16, pk::grouped_matmul::Kind::kForward>;
