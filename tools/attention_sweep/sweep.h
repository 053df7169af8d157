// What each configuration of config.cu (one translation unit each,
// -DPK_SWEEP_INDEX=i) hands main.cu: it registers itself at static
// initialization.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "kernels/ring_attention/ring_attention.h"

namespace pk_sweep {

struct Config {
  int index;         // PK_SWEEP_INDEX: the order rows are printed in
  const char* name;
  int head_dim;
  cudaError_t (*load)();
  cudaError_t (*run)(const pk::ring_attention::Params& p);
};

// Every registered configuration (main.cu sorts them by index).
std::vector<Config>& configs();
inline bool add(const Config& c) {
  configs().push_back(c);
  return true;
}

}  // namespace pk_sweep
