// Instantiation: ring attention, bf16 inputs, head dim 128 under a causal mask (the lazy rescale), mechanism ld_st.
#include "kernels/ring_attention/attention_sm90.cuh"

template struct pk::ring_attention::Variant<pk::ring_attention::DType::kBF16, 128,
                                            pk::ring_attention::Mechanism::kLdSt,
                                            pk::ring_attention::Form::kCausalLazy>;
