// Instantiation: ring attention, bf16 inputs, head dim 128, persistent CTAs, mechanism copy_engine.
#include "kernels/ring_attention/attention_sm90.cuh"

template struct pk::ring_attention::Variant<pk::ring_attention::DType::kBF16, 128,
                                            pk::ring_attention::Mechanism::kCopyEngine,
                                            pk::ring_attention::Form::kPersistent>;
