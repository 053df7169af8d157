#include "runtime/workspace.h"

#include <cuda.h>  // driver types only: cuCtxGetCurrent / cuCtxSetCurrent come by entry point
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

namespace pk::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// Scratch for the GEMM kernels (CUTLASS's persistent scheduler needs a few
// KiB; this leaves room for split-K variants).
constexpr size_t kGemmWorkspaceBytes = size_t(16) << 20;

// Bound of init's own wait (the zeroing of the flags, on our side stream).
constexpr double kInitWaitSeconds = 60;

// Longest bound a caller can ask for (keeps the time arithmetic finite).
constexpr double kMaxTimeoutSeconds = 1e7;

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

std::string cuda_message(const char* call, int ordinal, cudaError_t e) {
  // std::string only: iostreams crashed when the host process loaded another
  // libstdc++ build (seen on the GPU machines' Python).
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

std::string seconds(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

std::string check_timeout(double timeout_s) {
  if (!(timeout_s > 0) || !std::isfinite(timeout_s))
    return "pk_jax runtime: timeout_s must be a positive number of seconds, got " +
           std::to_string(timeout_s);
  return "";
}

Clock::time_point deadline_after(double s) {
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

const CtxApi& ctx_api() {
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
std::string wait_stream(cudaStream_t s, int ordinal, const char* what, Clock::time_point deadline,
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

// PCI addresses of every visible CUDA device, by ordinal.
std::string visible_pci_ids(std::vector<PciId>* out) {
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

std::string check_ordinal(int ordinal, int* count) {
  PK_RT_TRY(cudaGetDeviceCount(count), -1);
  if (ordinal < 0 || ordinal >= *count)
    return "pk_jax runtime: device ordinal " + std::to_string(ordinal) +
           " out of range (CUDA sees " + std::to_string(*count) + " devices)";
  return "";
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

bool same_handle(const cudaIpcMemHandle_t& a, const cudaIpcMemHandle_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
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

std::string Runtime::export_workspace(int ordinal, std::string* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return "pk_jax runtime: export_workspace before init_runtime";
  if (ordinal < 0 || ordinal >= int(devices_.size()) || devices_[ordinal].ordinal < 0)
    return "pk_jax runtime: device ordinal " + std::to_string(ordinal) +
           " is not driven by this process (export_workspace takes a local CUDA ordinal)";
  DeviceState& d = devices_[ordinal];
  if (!d.exported) {
    DeviceGuard guard;
    PK_RT_TRY(cudaSetDevice(d.ordinal), d.ordinal);
    PK_RT_TRY(cudaIpcGetMemHandle(&d.ipc_handle, d.workspace), d.ordinal);
    d.exported = true;
  }
  handle->assign(reinterpret_cast<const char*>(&d.ipc_handle), sizeof(d.ipc_handle));
  return "";
}

PeerState* Runtime::find_peer(int64_t id) {
  for (auto& p : peers_)
    if (p->global_id == id) return p.get();
  return nullptr;
}

const PeerState* Runtime::find_peer(int64_t id) const {
  for (const auto& p : peers_)
    if (p->global_id == id) return p.get();
  return nullptr;
}

std::string Runtime::import_peer(int64_t global_id, const std::string& handle,
                                 const std::string& pci_bus_id, int64_t data_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string who = "pk_jax runtime: import_peer(device id " + std::to_string(global_id) + ")";
  if (!ready_) return who + " before init_runtime";
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return who + ": a workspace handle has " + std::to_string(sizeof(cudaIpcMemHandle_t)) +
           " bytes, got " + std::to_string(handle.size());
  const std::optional<PciId> pci = parse_pci_bus_id(pci_bus_id);
  if (!pci) return who + ": cannot parse the PCI bus id '" + pci_bus_id + "'";
  if (data_bytes >= 0 && uint64_t(data_bytes) != data_bytes_)
    return who + ": its workspace data area has " + std::to_string(data_bytes) +
           " bytes and ours " + std::to_string(data_bytes_) + ": every process must use the "
           "same pk_jax.configure(workspace_bytes=...) / PK_JAX_WORKSPACE_BYTES";
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  for (const DeviceState& d : devices_) {
    if (d.ordinal < 0) continue;
    if (d.global_id == global_id)
      return who + ": that device is driven by this process (CUDA device " +
             std::to_string(d.ordinal) + "); import_peer is for devices of other processes";
    if (d.exported && same_handle(d.ipc_handle, h))
      return who + ": the handle is this process's own workspace of device id " +
             std::to_string(d.global_id);
  }
  if (PeerState* p = find_peer(global_id)) {
    if (same_handle(p->handle, h) && p->pci == *pci) return "";
    return who + ": already imported with another workspace handle or PCI bus id (did its "
           "process restart?); a mapped workspace cannot be replaced: restart every process";
  }
  for (const auto& p : peers_)
    if (same_handle(p->handle, h))
      return who + ": this handle was already imported as device id " +
             std::to_string(p->global_id);
  auto peer = std::make_unique<PeerState>();
  peer->global_id = global_id;
  peer->handle = h;
  peer->pci = *pci;
  for (int i = 0; i < int(visible_pci_.size()); ++i)
    if (visible_pci_[i] == *pci) peer->visible_ordinal = i;
  peer->mapped.assign(devices_.size(), nullptr);
  peers_.push_back(std::move(peer));
  return "";
}

std::string Runtime::describe_device(int64_t global_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const DeviceState& d : devices_)
    if (d.ordinal >= 0 && d.global_id == global_id)
      return "device id " + std::to_string(global_id) + " (CUDA device " +
             std::to_string(d.ordinal) + " of this process, PCI " + format_pci_bus_id(d.pci) + ")";
  if (const PeerState* p = find_peer(global_id))
    return "device id " + std::to_string(global_id) + " (another process's GPU, PCI " +
           format_pci_bus_id(p->pci) + ")";
  return "device id " + std::to_string(global_id);
}

// Without mu_ held (a CUDA call may wait for the device, and handlers on
// other threads need the table meanwhile). `self`, `local` and a peer's
// handle, PCI id and visible ordinal never change once set; `*mapped`
// receives a peer's mapping, which the caller records under mu_.
std::string Runtime::connect_pair(const DeviceState& self, int64_t other_id,
                                  const DeviceState* local, const PeerState* peer,
                                  char** mapped) {
  const auto no_path = [&](const std::string& why) {
    return "pk_jax runtime: " + describe_device(self.global_id) + " cannot access " +
           describe_device(other_id) + " directly (" + why + "); pk_jax kernels need NVLink "
           "or PCIe peer-to-peer access between every pair of GPUs of a group";
  };
  if (local != nullptr) {
    int can = 0;
    PK_RT_TRY(cudaDeviceCanAccessPeer(&can, self.ordinal, local->ordinal), self.ordinal);
    if (!can) return no_path("cudaDeviceCanAccessPeer is false");
    PK_RT_TRY(cudaSetDevice(self.ordinal), self.ordinal);
    const cudaError_t e = cudaDeviceEnablePeerAccess(local->ordinal, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // XLA's client may have enabled it already
    } else if (e != cudaSuccess) {
      cudaGetLastError();
      return "pk_jax runtime: enabling peer access from " + describe_device(self.global_id) +
             " to " + describe_device(other_id) + " failed: " + cuda_text(e);
    }
    return "";
  }
  if (peer->pci != self.pci) {
    // No cudaDeviceEnablePeerAccess towards the peer's GPU: that would create
    // a context on it in this process. The IPC mapping below enables the
    // access it needs (cudaIpcMemLazyEnablePeerAccess), even for a GPU this
    // process does not see; first ask whether a path exists, for a clear
    // message.
    if (peer->visible_ordinal >= 0) {
      int can = 0;
      PK_RT_TRY(cudaDeviceCanAccessPeer(&can, self.ordinal, peer->visible_ordinal), self.ordinal);
      if (!can) return no_path("cudaDeviceCanAccessPeer is false");
    } else if (std::optional<bool> can = nvml_p2p_read_write(self.pci, peer->pci); can && !*can) {
      return no_path("NVML reports no peer-to-peer read/write path");
    }
  }
  // The mapping belongs to the context of the device current here: open it
  // with `self` current, since self's kernels and copies use it.
  PK_RT_TRY(cudaSetDevice(self.ordinal), self.ordinal);
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, peer->handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "pk_jax runtime: mapping the workspace of " + describe_device(other_id) + " on " +
           describe_device(self.global_id) + " (cudaIpcOpenMemHandle) failed: " + cuda_text(e) +
           ". Mapping another process's GPU memory needs CUDA IPC between the two processes "
           "(same host and user, a shared IPC namespace in containers, no MIG) and a "
           "peer-to-peer path between the GPUs";
  }
  *mapped = static_cast<char*>(p);
  return "";
}

std::string Runtime::connect_group(const std::vector<int64_t>& global_ids) {
  // One connect_group at a time; the table lock only around table access.
  std::lock_guard<std::mutex> connecting(connect_mu_);
  struct Pair {
    const DeviceState* self;
    int64_t other;
    const DeviceState* local;
    PeerState* peer;
  };
  std::vector<Pair> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ready_) return "pk_jax runtime: connect_group before init_runtime";
    const int n = int(global_ids.size());
    if (n < 1 || n > kMaxRanks)
      return "pk_jax runtime: connect_group: group size " + std::to_string(n) +
             " unsupported (1.." + std::to_string(kMaxRanks) + ")";
    std::vector<const DeviceState*> locals(n, nullptr);
    std::vector<PeerState*> peers(n, nullptr);
    bool any_local = false;
    for (int q = 0; q < n; ++q) {
      for (int k = 0; k < q; ++k)
        if (global_ids[k] == global_ids[q])
          return "pk_jax runtime: connect_group: device id " + std::to_string(global_ids[q]) +
                 " appears twice in one group";
      for (const DeviceState& d : devices_)
        if (d.ordinal >= 0 && d.global_id == global_ids[q]) locals[q] = &d;
      if (locals[q] == nullptr) peers[q] = find_peer(global_ids[q]);
      any_local |= locals[q] != nullptr;
    }
    if (!any_local) return "";
    for (int q = 0; q < n; ++q)
      if (locals[q] == nullptr && peers[q] == nullptr)
        return "pk_jax runtime: connect_group: device id " + std::to_string(global_ids[q]) +
               " is not known to this process: it is driven by another process that did not "
               "share its workspace (import_peer) or lives on another host (pk_jax groups must "
               "stay inside one host)";
    for (int s = 0; s < n; ++s) {
      if (locals[s] == nullptr) continue;
      for (int q = 0; q < n; ++q)
        if (q != s && !connected_.count({locals[s]->ordinal, global_ids[q]}))
          todo.push_back({locals[s], global_ids[q], locals[q], peers[q]});
    }
  }
  if (todo.empty()) return "";
  DeviceGuard guard;
  for (const Pair& p : todo) {
    char* mapped = nullptr;
    if (std::string err = connect_pair(*p.self, p.other, p.local, p.peer, &mapped); !err.empty())
      return err;
    std::lock_guard<std::mutex> lock(mu_);
    if (p.peer != nullptr) p.peer->mapped[p.self->ordinal] = mapped;
    connected_.insert({p.self->ordinal, p.other});
  }
  return "";
}

std::string Runtime::can_access(int ordinal, const std::string& pci_bus_id, bool* out) {
  int count = 0;
  if (std::string err = check_ordinal(ordinal, &count); !err.empty()) return err;
  const std::optional<PciId> target = parse_pci_bus_id(pci_bus_id);
  if (!target) return "pk_jax runtime: cannot parse the PCI bus id '" + pci_bus_id + "'";
  std::vector<PciId> pci;
  if (std::string err = visible_pci_ids(&pci); !err.empty()) return err;
  if (pci[ordinal] == *target) {
    *out = true;  // the same GPU
    return "";
  }
  for (int i = 0; i < int(pci.size()); ++i) {
    if (pci[i] != *target) continue;
    int can = 0;
    PK_RT_TRY(cudaDeviceCanAccessPeer(&can, ordinal, i), ordinal);
    *out = can != 0;
    return "";
  }
  // Not visible here (CUDA_VISIBLE_DEVICES): NVML, else optimistic.
  *out = nvml_p2p_read_write(pci[ordinal], *target).value_or(true);
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

MemberStatus Runtime::member_workspaces(const DeviceState& self, const int64_t* ids, int n,
                                        char** out, int* bad, bool* remote) const {
  std::lock_guard<std::mutex> lock(mu_);
  *remote = false;
  for (int q = 0; q < n; ++q) {
    *bad = q;
    const int64_t id = ids[q];
    if (id == self.global_id) {
      out[q] = self.workspace;
      continue;
    }
    const DeviceState* local = nullptr;
    for (const DeviceState& d : devices_)
      if (d.ordinal >= 0 && d.global_id == id) local = &d;
    if (local != nullptr) {
      if (!connected_.count({self.ordinal, id})) return MemberStatus::kNotConnected;
      out[q] = local->workspace;
      continue;
    }
    const PeerState* peer = find_peer(id);
    if (peer == nullptr) return MemberStatus::kUnknown;
    if (self.ordinal >= int(peer->mapped.size()) || peer->mapped[self.ordinal] == nullptr)
      return MemberStatus::kNotConnected;
    out[q] = peer->mapped[self.ordinal];
    *remote = true;
  }
  return MemberStatus::kOk;
}

std::vector<PendingError> Runtime::pending_errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PendingError> out;
  for (const DeviceState& d : devices_) {
    if (d.ordinal < 0 || d.error_host == nullptr) continue;
    if (std::optional<ErrorRecord> r = recorded_error(d)) out.push_back({d.ordinal, *r});
  }
  return out;
}

BoundedWorker& Runtime::sync_worker(int ordinal) {
  std::unique_ptr<BoundedWorker>& w = sync_workers_[ordinal];
  if (!w) {
    const int64_t id = devices_[ordinal].global_id;
    w = std::make_unique<BoundedWorker>([ordinal, id]() -> std::string {
      cudaError_t e = cudaSetDevice(ordinal);
      if (e == cudaSuccess) e = cudaDeviceSynchronize();
      if (e == cudaSuccess) return "";
      cudaGetLastError();
      return "pk_jax runtime: waiting for device " + std::to_string(ordinal) + " (JAX id " +
             std::to_string(id) + ") failed: " + cuda_text(e) + "; a kernel on it failed (an "
             "error of this kind is sticky: the device's CUDA context stays unusable until the "
             "process restarts)";
    });
  }
  return *w;
}

namespace {

// One bounded wait for every local device at once: per ordinal, "" when it
// finished cleanly, else why not (timed_out marks the ones still running).
struct SyncResult {
  int ordinal;
  std::string error;
  bool timed_out = false;
};

}  // namespace

// With mu_ not held: the wait may be long, and handlers need the table.
static std::vector<SyncResult> sync_all(const std::vector<std::pair<int, int64_t>>& devices,
                                        const std::vector<BoundedWorker*>& workers,
                                        double timeout_s) {
  const Clock::time_point deadline = deadline_after(timeout_s);
  std::vector<uint64_t> tickets;
  for (BoundedWorker* w : workers) tickets.push_back(w->request());
  std::vector<SyncResult> out;
  for (size_t i = 0; i < workers.size(); ++i) {
    SyncResult r{devices[i].first, ""};
    if (!workers[i]->wait(tickets[i], deadline, &r.error)) {
      r.timed_out = true;
      r.error = "pk_jax runtime: device " + std::to_string(devices[i].first) + " (JAX id " +
                std::to_string(devices[i].second) + ") did not finish within " +
                seconds(timeout_s) + ": a kernel may be hung (pk_jax's own waits give up "
                "after the op timeout; a kernel that is not pk_jax's, or a stopped peer "
                "process, may not). A thread keeps waiting for that device in the background";
    }
    out.push_back(std::move(r));
  }
  return out;
}

bool Runtime::local_workers(std::vector<std::pair<int, int64_t>>* devices,
                            std::vector<BoundedWorker*>* workers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return false;
  for (const DeviceState& d : devices_) {
    if (d.ordinal < 0) continue;
    devices->push_back({d.ordinal, d.global_id});
    workers->push_back(&sync_worker(d.ordinal));
  }
  return true;
}

std::string Runtime::synchronize(double timeout_s) {
  if (std::string err = check_timeout(timeout_s); !err.empty()) return err;
  std::vector<std::pair<int, int64_t>> devices;
  std::vector<BoundedWorker*> workers;
  if (!local_workers(&devices, &workers)) return "";
  std::vector<std::string> errors;
  for (const SyncResult& r : sync_all(devices, workers, timeout_s))
    if (!r.error.empty()) errors.push_back(r.error);
  return join_lines(errors);
}

std::string Runtime::reset(double timeout_s) {
  if (std::string err = check_timeout(timeout_s); !err.empty()) return err;
  std::lock_guard<std::mutex> control(control_mu_);
  std::vector<std::pair<int, int64_t>> devices;
  std::vector<BoundedWorker*> workers;
  if (!local_workers(&devices, &workers)) return "";
  const Clock::time_point start = Clock::now();
  std::vector<SyncResult> synced = sync_all(devices, workers, timeout_s);
  // The zeroing itself gets what is left of the bound, and at least a second.
  const double left = timeout_s - std::chrono::duration<double>(Clock::now() - start).count();
  const double bound = std::max(left, 1.0);
  const Clock::time_point deadline = deadline_after(bound);
  std::vector<std::string> errors;
  std::vector<std::string> done;
  DeviceGuard guard;
  for (const SyncResult& r : synced) {
    // devices_ is fixed once ready: no lock needed to use an entry.
    DeviceState& d = devices_[r.ordinal];
    std::string err = r.error;
    if (err.empty()) {
      // Epochs restart at 0: every flag and line must too (all in [0,
      // kDataOffset); the data area holds no flags).
      cudaError_t e = cudaSetDevice(d.ordinal);
      if (e == cudaSuccess) e = cudaMemsetAsync(d.workspace, 0, kDataOffset, d.side_stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        err = cuda_message("zeroing the workspace flags", d.ordinal, e);
      } else {
        err = wait_stream(d.side_stream, d.ordinal, "zeroing the workspace flags", deadline, bound,
                          nullptr);
      }
    }
    if (!err.empty()) {
      errors.push_back(err + " [device " + std::to_string(d.ordinal) + " was NOT reset]");
      continue;
    }
    std::memset(d.error_host, 0, sizeof(ErrorRecord));
    done.push_back(std::to_string(d.ordinal));
  }
  if (errors.empty()) return "";
  std::string reset_ones;
  for (const std::string& s : done) reset_ones += (reset_ones.empty() ? "" : ", ") + s;
  return "pk_jax runtime: reset incomplete (devices reset: " +
         (reset_ones.empty() ? std::string("none") : reset_ones) + "):\n" + join_lines(errors);
}

std::optional<ErrorRecord> recorded_error(const DeviceState& d) {
  // Field by field through volatile: a kernel may be writing the record.
  const volatile ErrorRecord* r = d.error_host;
  if (r->code == kErrNone) return std::nullopt;
  ErrorRecord copy;
  copy.code = r->code; copy.op = r->op; copy.rank = r->rank; copy.peer = r->peer;
  copy.what = r->what; copy.pad = 0; copy.expected = r->expected; copy.observed = r->observed;
  copy.expected_row_bytes = r->expected_row_bytes;
  copy.observed_row_bytes = r->observed_row_bytes;
  copy.unsafe = r->unsafe;
  copy.unsafe_peer = r->unsafe_peer;
  return copy;
}

namespace {

// What a timed-out wait waited for (WaitKind).
std::string waited_for(const ErrorRecord& r) {
  const std::string e = std::to_string(r.expected);
  switch (r.what) {
    case kWaitPosted: return "post for epoch " + e;
    case kWaitLine: return "send its data lines for epoch " + e;
    case kWaitPiece: return "post a piece of its K/V block, stamp " + e;
    case kWaitClaimedDone: return "finish with the buffer it claimed";
    case kWaitOffer:
      return "offer its buffer for epoch " + e + "; saw offer word " +
             std::to_string(r.observed) + " (epoch " + std::to_string(r.observed / 4) +
             ", state " + std::to_string(r.observed % 4) + ")";
    default: return "finish its transfer for epoch " + e;
  }
}

}  // namespace

std::string describe(const ErrorRecord& r, int ordinal) {
  static const char* kOps[] = {"?", "all_gather", "all_gather_matmul",
                               "matmul_reduce_scatter", "ring_attention",
                               "ring_attention_bwd", "all_reduce", "reduce_scatter",
                               "matmul_all_reduce", "moe", "all_gather_matmul (backward)",
                               "matmul_reduce_scatter (backward)"};
  const char* op = (r.op > 0 && r.op < int(std::size(kOps))) ? kOps[r.op] : "?";
  const std::string where = std::string("pk_jax.") + op + " on device " +
                            std::to_string(ordinal) + " (rank " + std::to_string(r.rank) + "): ";
  const std::string peer = "peer rank " + std::to_string(r.peer);
  std::string text;
  switch (r.code) {
    case kErrRevoked:
      text = where + peer + " had revoked its offer for epoch " + std::to_string(r.expected) +
             " (it gave up waiting; this rank arrived after the timeout); nothing was copied";
      break;
    case kErrLayout:
      text = where + peer + "'s block layout (" + std::to_string(r.observed) + "x" +
             std::to_string(r.observed_row_bytes) + ") differs from this rank's (" +
             std::to_string(r.expected) + "x" + std::to_string(r.expected_row_bytes) +
             ") on a shared channel: two programs ran their collectives in different orders; "
             "nothing was copied";
      break;
    case kErrClobbered:
      text = where + peer + " overwrote this rank's staging slot (its epoch " +
             std::to_string(r.observed) + ") before this rank's call " +
             std::to_string(r.expected) + " finished reading it (its credit wait timed out)";
      break;
    case kErrAborted:
      text = where + "the call was aborted after part of it was enqueued";
      break;
    default:
      text = where + "timed out waiting for " + peer + " to " + waited_for(r) +
             (r.what == kWaitOffer ? "" : " but saw " + std::to_string(r.observed)) +
             ". The peer is missing, hung, or ran a different program";
  }
  text += ". The outputs of that call and of later pk_jax calls on this device are poisoned "
          "(NaN; integer gathers: all bits set) until pk_jax.check_errors() clears this state.";
  if (r.unsafe)
    text += " UNSAFE: returned buffers to XLA while peer rank " + std::to_string(r.unsafe_peer) +
            " still held them after a second timeout; memory may be corrupt, restart the "
            "process.";
  return text;
}

}  // namespace pk::runtime
