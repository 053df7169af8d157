// Runtime: init (one workspace, error record, streams and events per local
// GPU; every kernel loader run on each), device queries, the device table.
#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "runtime/internal.h"

namespace pk::runtime {

using namespace internal;

namespace {

// Scratch for the GEMM kernels (CUTLASS's persistent scheduler needs a few
// KiB; this leaves room for split-K variants).
constexpr size_t kGemmWorkspaceBytes = size_t(16) << 20;

// Bound of init's own wait (the zeroing of the flags, on our side stream).
constexpr double kInitWaitSeconds = 60;

// Frees whatever init_device allocated on `d`. `hung`: the device did not
// finish our work, so calls that wait for it (cudaFree, cudaFreeHost) are
// skipped and their memory is leaked rather than blocking forever.
void release_device(DeviceState& d, bool hung) {
  if (d.ordinal < 0) return;
  const bool allocated = d.side_stream || d.copy_stream || d.fork || d.join || d.copy_done ||
                         d.workspace || d.gemm_workspace || d.error_host;
  if (allocated && cudaSetDevice(d.ordinal) == cudaSuccess) {
    for (cudaEvent_t ev : {d.fork, d.join, d.copy_done})
      if (ev != nullptr) cudaEventDestroy(ev);
    for (cudaStream_t s : {d.side_stream, d.copy_stream})
      if (s != nullptr) cudaStreamDestroy(s);
    if (!hung) {
      if (d.gemm_workspace != nullptr) cudaFree(d.gemm_workspace);
      if (d.workspace != nullptr) cudaFree(d.workspace);
      if (d.error_host != nullptr) cudaFreeHost(d.error_host);
    }
  }
  cudaGetLastError();
  const int ordinal = d.ordinal;
  const int64_t id = d.global_id;
  const PciId pci = d.pci;
  d = DeviceState{};
  d.ordinal = ordinal;
  d.global_id = id;
  d.pci = pci;
}

std::string init_device(DeviceState& d, size_t bytes, const std::vector<KernelLoader>& loaders,
                        bool* hung) {
  PK_RT_TRY(cudaSetDevice(d.ordinal), d.ordinal);
  int major = 0, minor = 0;
  PK_RT_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d.ordinal), d.ordinal);
  PK_RT_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d.ordinal), d.ordinal);
  if (major != 9 || minor != 0)
    return "pk_jax runtime: device " + std::to_string(d.ordinal) + " (JAX id " +
           std::to_string(d.global_id) + ") has compute capability " + std::to_string(major) +
           "." + std::to_string(minor) + "; the pk_jax kernels are built for sm_90a (Hopper) only";
  PK_RT_TRY(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, d.ordinal),
            d.ordinal);
  PK_RT_TRY(cudaStreamCreateWithFlags(&d.side_stream, cudaStreamNonBlocking), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.fork, cudaEventDisableTiming), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.join, cudaEventDisableTiming), d.ordinal);
  PK_RT_TRY(cudaStreamCreateWithFlags(&d.copy_stream, cudaStreamNonBlocking), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.copy_done, cudaEventDisableTiming), d.ordinal);
  // A plain cudaMalloc: the allocation CUDA IPC exports (export_workspace).
  void* ws = nullptr;
  PK_RT_TRY(cudaMalloc(&ws, bytes), d.ordinal);
  d.workspace = static_cast<char*>(ws);
  // Flags and lines only (pk/layout.h): the data area needs no zeroes.
  PK_RT_TRY(cudaMemsetAsync(ws, 0, kDataOffset, d.side_stream), d.ordinal);
  void* host = nullptr;
  PK_RT_TRY(cudaHostAlloc(&host, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable),
            d.ordinal);
  std::memset(host, 0, sizeof(ErrorRecord));
  d.error_host = static_cast<ErrorRecord*>(host);
  void* dev = nullptr;
  PK_RT_TRY(cudaHostGetDevicePointer(&dev, host, 0), d.ordinal);
  d.error_device = static_cast<ErrorRecord*>(dev);
  d.gemm_workspace_bytes = kGemmWorkspaceBytes;
  PK_RT_TRY(cudaMalloc(&d.gemm_workspace, d.gemm_workspace_bytes), d.ordinal);
  for (KernelLoader load : loaders) PK_RT_TRY(load(), d.ordinal);
  // The zeroes must land before any kernel (on XLA's streams) reads them.
  return wait_stream(d.side_stream, d.ordinal, "zeroing the workspace flags",
                     deadline_after(kInitWaitSeconds), kInitWaitSeconds, hung);
}

}  // namespace

Runtime& Runtime::get() {
  static Runtime* r = new Runtime();  // never destroyed: XLA may outlive statics
  return *r;
}

std::string Runtime::init(const std::vector<std::pair<int64_t, int>>& devices,
                          size_t data_bytes, const std::vector<KernelLoader>& loaders) {
  std::lock_guard<std::mutex> control(control_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, int>> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  if (ready_) {
    if (data_bytes != data_bytes_)
      return "pk_jax runtime: already initialized with a workspace of " +
             std::to_string(data_bytes_) + " data bytes; workspace_bytes can only be "
             "set before the first pk_jax op runs";
    if (sorted != init_devices_)
      return "pk_jax runtime: already initialized for other devices (" +
             std::to_string(init_devices_.size()) + " (JAX id, CUDA ordinal) pairs, now " +
             std::to_string(sorted.size()) + " different ones): the local devices are fixed "
             "by the first pk_jax op";
    return "";
  }
  if (devices.empty()) return "pk_jax runtime: init needs at least one local device";
  std::vector<PciId> pci;
  if (std::string err = visible_pci_ids(&pci); !err.empty()) return err;
  const int count = int(pci.size());
  std::vector<DeviceState> table(count);
  for (auto [id, ordinal] : devices) {
    if (ordinal < 0 || ordinal >= count)
      return "pk_jax runtime: local device ordinal " + std::to_string(ordinal) +
             " out of range (CUDA sees " + std::to_string(count) + " devices)";
    if (table[ordinal].ordinal >= 0)
      return "pk_jax runtime: local device ordinal " + std::to_string(ordinal) + " given twice";
    for (const DeviceState& d : table)
      if (d.ordinal >= 0 && d.global_id == id)
        return "pk_jax runtime: JAX device id " + std::to_string(id) + " given twice";
    table[ordinal].ordinal = ordinal;
    table[ordinal].global_id = id;
    table[ordinal].pci = pci[ordinal];
  }
  DeviceGuard guard;
  for (DeviceState& d : table) {
    if (d.ordinal < 0) continue;
    bool hung = false;
    std::string err = init_device(d, kDataOffset + data_bytes, loaders, &hung);
    if (err.empty()) continue;
    // Leave nothing behind: a later call starts from scratch.
    for (DeviceState& x : table) release_device(x, hung && &x == &d);
    return err;
  }
  devices_ = std::move(table);
  visible_pci_ = std::move(pci);
  init_devices_ = std::move(sorted);
  data_bytes_ = data_bytes;
  sync_workers_.clear();
  sync_workers_.resize(devices_.size());
  std::atomic_thread_fence(std::memory_order_release);
  ready_ = true;
  return "";
}

bool Runtime::initialized() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

std::string Runtime::device_info(int ordinal, DeviceInfo* out) {
  int count = 0;
  if (std::string err = check_ordinal(ordinal, &count); !err.empty()) return err;
  char buf[64] = {};
  PK_RT_TRY(cudaDeviceGetPCIBusId(buf, sizeof(buf), ordinal), ordinal);
  int ipc = 0;
  PK_RT_TRY(cudaDeviceGetAttribute(&out->major, cudaDevAttrComputeCapabilityMajor, ordinal), ordinal);
  PK_RT_TRY(cudaDeviceGetAttribute(&out->minor, cudaDevAttrComputeCapabilityMinor, ordinal), ordinal);
  PK_RT_TRY(cudaDeviceGetAttribute(&ipc, cudaDevAttrIpcEventSupport, ordinal), ordinal);
  out->pci_bus_id = buf;
  out->supported = out->major == 9 && out->minor == 0;
  out->ipc = ipc != 0;
  return "";
}

const DeviceState* Runtime::by_ordinal(int ordinal) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_ || ordinal < 0 || ordinal >= int(devices_.size())) return nullptr;
  const DeviceState& d = devices_[ordinal];
  return d.ordinal < 0 ? nullptr : &d;
}

const DeviceState* Runtime::by_global_id(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return nullptr;
  for (const DeviceState& d : devices_)
    if (d.ordinal >= 0 && d.global_id == id) return &d;
  return nullptr;
}

}  // namespace pk::runtime
