// Instantiation: ring attention, bf16 inputs, head dim 256, 80 keys a tile, mechanism copy_engine.
// 80-wide wgmma is among cute's extended shapes: enabled before any cute header.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "kernels/ring_attention/attention_sm90.cuh"

template struct pk::ring_attention::Variant<pk::ring_attention::DType::kBF16, 256,
                                            pk::ring_attention::Mechanism::kCopyEngine>;
