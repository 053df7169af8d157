// Instantiation: block backward, f16 inputs, head dim 128.
#include "kernels/attention_bwd/attention_bwd_sm90.cuh"

template struct pk::attention_bwd::Variant<pk::attention_bwd::DType::kF16, 128>;
