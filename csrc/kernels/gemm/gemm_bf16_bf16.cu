// Instantiation: bf16 inputs, bf16 output.
#include "kernels/gemm/gemm_sm90.cuh"

namespace pk::gemm {

cudaError_t run_bf16_bf16(const Problem& p, const Device& dev, cudaStream_t stream) {
  return Sm90Gemm<cutlass::bfloat16_t, cutlass::bfloat16_t>::run(p, dev, stream);
}

cudaError_t load_bf16_bf16() { return Sm90Gemm<cutlass::bfloat16_t, cutlass::bfloat16_t>::load(); }

}  // namespace pk::gemm
