// Instantiation: f16 inputs, f16 output, 128x128 ping-pong tiles (tile_table.h).
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kF16, pk::gemm::DType::kF16, false, false,
                                  pk::gemm::Tiles::kNarrow>;
