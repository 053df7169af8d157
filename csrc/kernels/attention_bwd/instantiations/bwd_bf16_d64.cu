// Instantiation: block backward, bf16 inputs, head dim 64.
#include "kernels/attention_bwd/attention_bwd_sm90.cuh"

template struct pk::attention_bwd::Variant<pk::attention_bwd::DType::kBF16, 64>;
