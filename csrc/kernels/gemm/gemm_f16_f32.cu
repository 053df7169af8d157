// Instantiation: f16 inputs, f32 output.
#include "kernels/gemm/gemm_sm90.cuh"

namespace pk::gemm {

cudaError_t run_f16_f32(const Problem& p, const Device& dev, cudaStream_t stream) {
  return Sm90Gemm<cutlass::half_t, float>::run(p, dev, stream);
}

cudaError_t load_f16_f32() { return Sm90Gemm<cutlass::half_t, float>::load(); }

}  // namespace pk::gemm
