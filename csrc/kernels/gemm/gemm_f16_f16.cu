// Instantiation: f16 inputs, f16 output.
#include "kernels/gemm/gemm_sm90.cuh"

namespace pk::gemm {

cudaError_t run_f16_f16(const Problem& p, const Device& dev, cudaStream_t stream) {
  return Sm90Gemm<cutlass::half_t, cutlass::half_t>::run(p, dev, stream);
}

cudaError_t load_f16_f16() { return Sm90Gemm<cutlass::half_t, cutlass::half_t>::load(); }

}  // namespace pk::gemm
