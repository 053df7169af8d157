// Instantiation: bf16 inputs, bf16 output, 128x128 ping-pong tiles (tile_table.h).
#include "kernels/gemm/gemm_sm90.cuh"

template struct pk::gemm::Variant<pk::gemm::DType::kBF16, pk::gemm::DType::kBF16, false, false,
                                  pk::gemm::Tiles::kNarrow>;
