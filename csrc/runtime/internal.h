// What the runtime's files share (workspace.cc: init and allocation; ipc.cc:
// export and import of workspaces; peers.cc: connecting the members of a
// group; recovery.cc: bounded synchronize and reset; errors.cc: the error
// records and their text): CUDA error messages, bounded stream waits, the
// guard that restores the caller's CUDA context, the visible devices' PCI
// ids. The state itself is the Runtime class (workspace.h). Included by
// csrc/runtime/*.cc only.
#pragma once

#include <cuda.h>  // driver types only: cuCtxGetCurrent / cuCtxSetCurrent come by entry point
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/topology.h"

namespace pk::runtime::internal {

using Clock = std::chrono::steady_clock;

// Longest bound a caller can ask for (keeps the time arithmetic finite).
inline constexpr double kMaxTimeoutSeconds = 1e7;

inline std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

inline std::string cuda_message(const char* call, int ordinal, cudaError_t e) {
  // std::string only: iostreams crashed when the host process had loaded
  // another libstdc++ build.
  return std::string("pk_jax runtime: ") + call +
         (ordinal >= 0 ? " on device " + std::to_string(ordinal) : std::string()) +
         " failed: " + cuda_text(e);
}

#define PK_RT_TRY(call, ordinal)                                            \
  do {                                                                      \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) {                       \
      cudaGetLastError();                                                   \
      return cuda_message(#call, ordinal, e_);                              \
    }                                                                       \
  } while (0)

inline std::string seconds(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

inline Clock::time_point deadline_after(double s) {
  s = std::min(s, kMaxTimeoutSeconds);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// The thread's current CUDA context, saved and restored through the driver
// API: the runtime API's cudaGetDevice answers 0 on a thread with no context
// and cudaSetDevice(0) would then create a context on GPU 0 in a process that
// drives another GPU (one process per GPU: hundreds of MiB on a GPU that
// belongs to another process).
struct CtxApi {
  CUresult (*get)(CUcontext*) = nullptr;
  CUresult (*set)(CUcontext) = nullptr;
};

inline const CtxApi& ctx_api() {
  static const CtxApi api = [] {
    CtxApi a;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult qg{}, qs{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &qg) ==
            cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &qs) ==
            cudaSuccess &&
        qg == cudaDriverEntryPointSuccess && qs == cudaDriverEntryPointSuccess && get && set) {
      a.get = reinterpret_cast<CUresult (*)(CUcontext*)>(get);
      a.set = reinterpret_cast<CUresult (*)(CUcontext)>(set);
    }
    cudaGetLastError();
    return a;
  }();
  return api;
}

// Restores the caller's current context: the runtime runs on JAX threads.
struct DeviceGuard {
  CUcontext ctx = nullptr;
  bool have_ctx = false;
  int saved = -1;
  DeviceGuard() {
    const CtxApi& a = ctx_api();
    if (a.get != nullptr && a.set != nullptr) {
      have_ctx = a.get(&ctx) == CUDA_SUCCESS;
    } else if (cudaGetDevice(&saved) != cudaSuccess) {
      saved = -1;
      cudaGetLastError();
    }
  }
  ~DeviceGuard() {
    if (have_ctx) {
      ctx_api().set(ctx);
    } else if (saved >= 0) {
      cudaSetDevice(saved);
      cudaGetLastError();
    }
  }
};

// Polls `s` until its work is done, at most until `deadline`. Our streams
// only: XLA's are not visible here.
inline std::string wait_stream(cudaStream_t s, int ordinal, const char* what, Clock::time_point deadline,
                        double bound_s, bool* timed_out) {
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return "";
    if (e != cudaErrorNotReady) {
      cudaGetLastError();
      return cuda_message(what, ordinal, e);
    }
    if (Clock::now() >= deadline) {
      if (timed_out != nullptr) *timed_out = true;
      return "pk_jax runtime: " + std::string(what) + " on device " + std::to_string(ordinal) +
             " did not finish within " + seconds(bound_s) + ": the GPU is busy with a kernel "
             "that does not end (hung?)";
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}

// PCI addresses of every visible CUDA device, by ordinal.
inline std::string visible_pci_ids(std::vector<PciId>* out) {
  int count = 0;
  PK_RT_TRY(cudaGetDeviceCount(&count), -1);
  out->assign(count, PciId{});
  for (int i = 0; i < count; ++i) {
    char buf[64] = {};
    PK_RT_TRY(cudaDeviceGetPCIBusId(buf, sizeof(buf), i), i);
    std::optional<PciId> id = parse_pci_bus_id(buf);
    if (!id)
      return "pk_jax runtime: cannot parse the PCI bus id '" + std::string(buf) + "' of device " +
             std::to_string(i);
    (*out)[i] = *id;
  }
  return "";
}

inline std::string check_ordinal(int ordinal, int* count) {
  PK_RT_TRY(cudaGetDeviceCount(count), -1);
  if (ordinal < 0 || ordinal >= *count)
    return "pk_jax runtime: device ordinal " + std::to_string(ordinal) +
           " out of range (CUDA sees " + std::to_string(*count) + " devices)";
  return "";
}

}  // namespace pk::runtime::internal
