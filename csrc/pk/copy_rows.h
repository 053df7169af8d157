// Strided device-to-device copies issued as one 1-D copy per row.
//
// Why not cudaMemcpy2DAsync: XLA runs our handlers inside CUDA graphs
// (command buffers, kCmdBufferCompatible) and, when a later call brings new
// buffer addresses, re-traces the handler and updates the instantiated graph
// in place. CUDA updates the addresses of 1-D memcpy nodes only
// (cuGraphExecNodeSetParams); a 2-D node makes the whole update fail with
// CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE. The copy engines run 1-D copies of a
// few hundred KiB and up at full rate, so the per-copy cost is launch only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace pk {

inline cudaError_t copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                             size_t row_bytes, size_t rows, cudaStream_t stream) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  for (size_t r = 0; r < rows; ++r) {
    if (cudaError_t e = cudaMemcpyAsync(d + r * dst_pitch, s + r * src_pitch, row_bytes,
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

}  // namespace pk
