// all_gather: the entry point. run() checks the call (supported) and hands it
// to its mechanism's file:
//   kLdStPull, kLdStPush: all_gather_ld_st.cu (one kernel, zero copy)
//   kCopyEngine:          all_gather_copy_engine.cu (copy engines, signals)
//   kLdStLl:              all_gather_ll.cu (one kernel, flagged lines)
#include <cuda_runtime.h>

#include "kernels/all_gather/all_gather.h"
#include "pk/cuda_check.h"

namespace pk::all_gather {

bool supported(const Params& p) {
  switch (p.mechanism) {
    case Mechanism::kLdStPull:
    case Mechanism::kLdStPush:
    case Mechanism::kCopyEngine:
      return true;
    case Mechanism::kLdStLl:
      return p.slot >= 0 && p.slot < kLlChannels && p.rows * p.row_bytes <= kLlMaxBytes &&
             p.row_bytes % 4 == 0;
  }
  return false;  // not a Mechanism
}

cudaError_t run(const Params& p) {
  if (!supported(p)) return cudaErrorInvalidValue;
  switch (p.mechanism) {
    case Mechanism::kLdStPull: return run_ld_st(p, /*push=*/false);
    case Mechanism::kLdStPush: return run_ld_st(p, /*push=*/true);
    case Mechanism::kCopyEngine: return run_copy_engine(p);
    case Mechanism::kLdStLl: return run_ll(p);
  }
  return cudaErrorInvalidValue;
}

cudaError_t load_kernels() {
  PK_CUDA_TRY(load_ld_st_kernels());
  return load_ll_kernels();
}

}  // namespace pk::all_gather
