#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

namespace pk::runtime {
namespace {

// Scratch for the GEMM kernels (CUTLASS's persistent scheduler needs a few
// KiB; this leaves room for split-K variants).
constexpr size_t kGemmWorkspaceBytes = size_t(16) << 20;

std::string cuda_message(const char* call, int ordinal, cudaError_t e) {
  // std::string only: iostreams crashed when the host process loaded another
  // libstdc++ build (seen on the GPU machines' Python).
  return std::string("pk_jax runtime: ") + call + " on device " + std::to_string(ordinal) +
         " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

#define PK_RT_TRY(call, ordinal)                                            \
  do {                                                                      \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) return cuda_message(#call, ordinal, e_); \
  } while (0)

// Restores the caller's current device: init runs on a JAX thread.
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

std::string enable_peer(int from, int to) {
  int can = 0;
  PK_RT_TRY(cudaDeviceCanAccessPeer(&can, from, to), from);
  if (!can) {
    return "pk_jax runtime: device " + std::to_string(from) + " cannot access device " +
           std::to_string(to) +
           " directly (no peer-to-peer path); pk_jax kernels need NVLink or PCIe P2P";
  }
  PK_RT_TRY(cudaSetDevice(from), from);
  cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // XLA's client may have enabled it already
  } else if (e != cudaSuccess) {
    return cuda_message("cudaDeviceEnablePeerAccess", from, e);
  }
  return "";
}

std::string init_device(DeviceState& d, size_t bytes,
                        const std::vector<KernelLoader>& loaders) {
  PK_RT_TRY(cudaSetDevice(d.ordinal), d.ordinal);
  void* ws = nullptr;
  PK_RT_TRY(cudaMalloc(&ws, bytes), d.ordinal);
  d.workspace = static_cast<char*>(ws);
  // Flags and lines only (pk/layout.h): the data area needs no zeroes.
  PK_RT_TRY(cudaMemset(ws, 0, kDataOffset), d.ordinal);
  void* host = nullptr;
  PK_RT_TRY(cudaHostAlloc(&host, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable),
            d.ordinal);
  std::memset(host, 0, sizeof(ErrorRecord));
  d.error_host = static_cast<ErrorRecord*>(host);
  void* dev = nullptr;
  PK_RT_TRY(cudaHostGetDevicePointer(&dev, host, 0), d.ordinal);
  d.error_device = static_cast<ErrorRecord*>(dev);
  PK_RT_TRY(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, d.ordinal),
            d.ordinal);
  PK_RT_TRY(cudaStreamCreateWithFlags(&d.side_stream, cudaStreamNonBlocking), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.fork, cudaEventDisableTiming), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.join, cudaEventDisableTiming), d.ordinal);
  PK_RT_TRY(cudaStreamCreateWithFlags(&d.copy_stream, cudaStreamNonBlocking), d.ordinal);
  PK_RT_TRY(cudaEventCreateWithFlags(&d.copy_done, cudaEventDisableTiming), d.ordinal);
  d.gemm_workspace_bytes = kGemmWorkspaceBytes;
  PK_RT_TRY(cudaMalloc(&d.gemm_workspace, d.gemm_workspace_bytes), d.ordinal);
  for (KernelLoader load : loaders) PK_RT_TRY(load(), d.ordinal);
  PK_RT_TRY(cudaDeviceSynchronize(), d.ordinal);
  return "";
}

}  // namespace

Runtime& Runtime::get() {
  static Runtime* r = new Runtime();  // never destroyed: XLA may outlive statics
  return *r;
}

std::string Runtime::init(const std::vector<std::pair<int64_t, int>>& devices,
                          size_t data_bytes, const std::vector<KernelLoader>& loaders) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_) {
    if (data_bytes != data_bytes_)
      return "pk_jax runtime: already initialized with a workspace of " +
             std::to_string(data_bytes_) + " data bytes; workspace_bytes can only be "
             "set before the first pk_jax op runs";
    return "";
  }
  int count = 0;
  PK_RT_TRY(cudaGetDeviceCount(&count), -1);
  std::vector<DeviceState> table(count);
  for (auto [id, ordinal] : devices) {
    if (ordinal < 0 || ordinal >= count)
      return "pk_jax runtime: local device ordinal " + std::to_string(ordinal) +
             " out of range (CUDA sees " + std::to_string(count) + " devices)";
    table[ordinal].ordinal = ordinal;
    table[ordinal].global_id = id;
  }
  DeviceGuard guard;
  for (auto& d : table) {
    if (d.ordinal < 0) continue;
    if (std::string err = init_device(d, kDataOffset + data_bytes, loaders); !err.empty())
      return err;
  }
  for (auto& a : table)
    for (auto& b : table)
      if (a.ordinal >= 0 && b.ordinal >= 0 && a.ordinal != b.ordinal)
        if (std::string err = enable_peer(a.ordinal, b.ordinal); !err.empty()) return err;
  devices_ = std::move(table);
  data_bytes_ = data_bytes;
  std::atomic_thread_fence(std::memory_order_release);
  ready_ = true;
  return "";
}

bool Runtime::initialized() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
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

std::vector<PendingError> Runtime::pending_errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PendingError> out;
  for (const DeviceState& d : devices_) {
    if (d.ordinal < 0) continue;
    if (std::optional<ErrorRecord> r = recorded_error(d)) out.push_back({d.ordinal, *r});
  }
  return out;
}

std::string Runtime::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return "";
  DeviceGuard guard;
  for (DeviceState& d : devices_) {
    if (d.ordinal < 0) continue;
    PK_RT_TRY(cudaSetDevice(d.ordinal), d.ordinal);
    PK_RT_TRY(cudaDeviceSynchronize(), d.ordinal);
  }
  for (DeviceState& d : devices_) {
    if (d.ordinal < 0) continue;
    PK_RT_TRY(cudaSetDevice(d.ordinal), d.ordinal);
    // Epochs restart at 0: every flag and line must too (all in [0,
    // kDataOffset); the data area holds no flags).
    PK_RT_TRY(cudaMemset(d.workspace, 0, kDataOffset), d.ordinal);
    PK_RT_TRY(cudaDeviceSynchronize(), d.ordinal);
    std::memset(d.error_host, 0, sizeof(ErrorRecord));
  }
  return "";
}

std::optional<ErrorRecord> recorded_error(const DeviceState& d) {
  // Field by field through volatile: a kernel may be writing the record.
  const volatile ErrorRecord* r = d.error_host;
  if (r->code == kErrNone) return std::nullopt;
  ErrorRecord copy;
  copy.code = r->code; copy.op = r->op; copy.rank = r->rank; copy.peer = r->peer;
  copy.what = r->what; copy.pad = 0; copy.expected = r->expected; copy.observed = r->observed;
  return copy;
}

std::string describe(const ErrorRecord& r, int ordinal) {
  static const char* kOps[] = {"?", "all_gather", "all_gather_matmul",
                               "matmul_reduce_scatter", "ring_attention"};
  const char* op = (r.op > 0 && r.op < int(std::size(kOps))) ? kOps[r.op] : "?";
  const char* what = r.what == kWaitPosted ? "post its address for epoch "
                     : r.what == kWaitLine ? "send its data lines for epoch "
                     : r.what == kWaitPiece ? "post a piece of its K/V block, stamp "
                                            : "finish its transfer for epoch ";
  return std::string("pk_jax.") + op + " timed out on device " + std::to_string(ordinal) +
         " (rank " + std::to_string(r.rank) + "): waited for peer rank " +
         std::to_string(r.peer) + " to " + what + std::to_string(r.expected) + " but saw " +
         std::to_string(r.observed) +
         ". The peer is missing, hung, or ran a different program; the outputs of that "
         "call are undefined. pk_jax.check_errors() clears this state.";
}

}  // namespace pk::runtime
