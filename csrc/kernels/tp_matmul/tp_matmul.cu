// The TP matmuls' entry point: run() hands the call to its op's sequence
// (tp_matmul.h has them all):
//   kAllGatherMatmul:     all_gather_matmul.cu
//   kMatmulReduceScatter: matmul_reduce_scatter.cu
//   kMatmulAllReduce:     matmul_all_reduce.cu (chunked or one_shot, by
//                         p.mechanism)
#include <cuda_runtime.h>

#include "kernels/tp_matmul/tp_matmul.h"

namespace pk::tp_matmul {

cudaError_t run(const Params& p) {
  switch (p.op) {
    case Op::kAllGatherMatmul: return all_gather_matmul(p);
    case Op::kMatmulReduceScatter: return matmul_reduce_scatter(p);
    case Op::kMatmulAllReduce:
      if (!is_all_reduce_mechanism(int32_t(p.mechanism))) return cudaErrorInvalidValue;
      return matmul_all_reduce(p);
  }
  return cudaErrorInvalidValue;  // not an Op
}

}  // namespace pk::tp_matmul
