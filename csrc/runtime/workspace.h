// Process-wide runtime: one symmetric workspace per local GPU, mapped by every
// peer, plus an error record per GPU in mapped host memory.
//
// Single process driving all local GPUs (the JAX default): peers map each
// other's workspace through peer access, so a workspace is a plain device
// pointer valid on every GPU. One process per GPU would exchange IPC handles
// at init and fill the same table; nothing below the table changes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pk/layout.h"

namespace pk::runtime {

struct DeviceState {
  int ordinal = -1;                     // local CUDA ordinal
  int64_t global_id = -1;               // JAX device id
  char* workspace = nullptr;            // kDataOffset + data_bytes; flags zeroed
  ErrorRecord* error_host = nullptr;    // mapped pinned memory, host view
  ErrorRecord* error_device = nullptr;  // device view of the same record
  int sm_count = 1;                      // multiprocessors
  cudaStream_t side_stream = nullptr;   // second stream for comm beside compute
  cudaEvent_t fork = nullptr;           // main -> side ordering
  cudaEvent_t join = nullptr;           // side -> main ordering
  cudaStream_t copy_stream = nullptr;   // beside side_stream: two copy engines at once
  cudaEvent_t copy_done = nullptr;      // copy_stream -> side_stream ordering
  void* gemm_workspace = nullptr;       // scratch of the GEMM kernels
  size_t gemm_workspace_bytes = 0;
};

// Loads one op's kernels on the current device (no lazy module load later,
// while a peer spins); may cache per-device launch limits.
using KernelLoader = cudaError_t (*)();

struct PendingError {
  int ordinal;
  ErrorRecord record;
};

class Runtime {
 public:
  static Runtime& get();

  // Allocates the workspaces of `devices` ((global id, local ordinal) pairs),
  // runs every loader on each of them, and enables peer access between all
  // of them. Returns an error message, or "" on success. A second call is a
  // no-op when it asks for the same size, and an error otherwise.
  std::string init(const std::vector<std::pair<int64_t, int>>& devices, size_t data_bytes,
                   const std::vector<KernelLoader>& loaders);

  bool initialized() const;
  size_t data_bytes() const { return data_bytes_; }

  // nullptr when the device is not managed (not initialized, or remote).
  const DeviceState* by_ordinal(int ordinal) const;
  const DeviceState* by_global_id(int64_t id) const;

  // Errors recorded by kernels and not yet cleared.
  std::vector<PendingError> pending_errors() const;

  // Waits for every device, then zeroes every flag and line ([0,
  // kDataOffset)) and the error records. For recovery after a timeout, when
  // no pk_jax kernel is in flight.
  std::string reset();

 private:
  Runtime() = default;
  mutable std::mutex mu_;
  bool ready_ = false;
  size_t data_bytes_ = 0;
  std::vector<DeviceState> devices_;  // indexed by local ordinal
};

// The error a kernel recorded on `d` and nobody cleared yet, or nullopt. The
// record is mapped host memory a kernel may write at any time: this is the
// one place that reads it.
std::optional<ErrorRecord> recorded_error(const DeviceState& d);

// Human-readable description of a kernel's error record.
std::string describe(const ErrorRecord& r, int ordinal);

}  // namespace pk::runtime
