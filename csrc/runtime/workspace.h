// Process-wide runtime: one symmetric workspace per local GPU, the
// workspaces of the other processes' GPUs of this host mapped in, and an
// error record per local GPU in mapped host memory.
//
// Local devices are the GPUs this process drives (init). Their workspaces
// are cudaMalloc'd, so in one process a workspace address is valid on every
// local GPU that enabled peer access to its owner. Peers are GPUs driven by
// other processes of the host (one process per GPU, jax.distributed): each
// exports its workspace as a CUDA IPC handle (export_workspace), the others
// register it (import_peer) and map it, once per local device that shares a
// group with it (connect_group), since an IPC mapping belongs to the context
// of the device that opened it. Kernels only ever see base pointers: every
// workspace has the same layout (pk/layout.h).
//
// Order of use (pk_jax/runtime.py): init, export_workspace of every local
// device, exchange (handle, PCI bus id) between processes, import_peer of
// every remote device, then connect_group of every group row that holds a
// local device, before any kernel of that group runs. Handlers refuse a
// member that was not connected (resolve_group, xla_ffi/ffi_common.h).
//
// Implemented by job: workspace.cc (init, device queries and table), ipc.cc
// (export_workspace, import_peer), peers.cc (connect_group, can_access,
// member_workspaces), recovery.cc (synchronize, reset), errors.cc (the error
// records and their text); internal.h holds what they share.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pk/layout.h"
#include "runtime/bounded_worker.h"
#include "runtime/topology.h"

namespace pk::runtime {

// A GPU this process drives.
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
  PciId pci;                            // where the GPU sits on this host
  bool exported = false;                // export_workspace ran: ipc_handle is set
  cudaIpcMemHandle_t ipc_handle{};
};

// A GPU of this host driven by another process: what kernels need of it.
struct PeerState {
  int64_t global_id = -1;      // JAX device id
  cudaIpcMemHandle_t handle{};  // its workspace, exported by its process
  PciId pci;
  int visible_ordinal = -1;    // its CUDA ordinal in this process; -1 when not visible
  std::vector<char*> mapped;   // by local ordinal: the workspace opened in that
                               // device's context, nullptr until connect_group
};

// Loads one op's kernels on the current device (no lazy module load later,
// while a peer spins); may cache per-device launch limits.
using KernelLoader = cudaError_t (*)();

struct PendingError {
  int ordinal;
  ErrorRecord record;
};

// device_info(): what the Python side needs to decide before init.
struct DeviceInfo {
  std::string pci_bus_id;  // as cudaDeviceGetPCIBusId writes it
  int major = 0;           // compute capability
  int minor = 0;
  bool supported = false;  // sm_90 exactly: what the kernels are built for
  bool ipc = false;        // cudaDevAttrIpcEventSupport: CUDA IPC works on it
};

// Outcome of looking a group member up for one local device.
enum class MemberStatus {
  kOk,
  kUnknown,       // neither driven by this process nor imported
  kNotConnected,  // known, but connect_group never covered (self, member)
};

// Every method returns "" on success or a message (module.cc raises it); a
// method that fails leaves the runtime as it was, unless it says otherwise.
class Runtime {
 public:
  static Runtime& get();

  // Allocates the workspaces of `devices` ((global id, local ordinal) pairs)
  // so that they can be exported (cudaMalloc), zeroes their flags, creates
  // streams and events, and runs every loader on each. Enables no peer
  // access (connect_group does). On failure frees everything it allocated
  // and leaves the runtime uninitialized: a later call starts afresh. A
  // second call after a success is a no-op with the same arguments and an
  // error otherwise.
  std::string init(const std::vector<std::pair<int64_t, int>>& devices, size_t data_bytes,
                   const std::vector<KernelLoader>& loaders);

  bool initialized() const;
  size_t data_bytes() const { return data_bytes_; }

  // Any visible CUDA device; needs no init and allocates nothing.
  static std::string device_info(int ordinal, DeviceInfo* out);

  // The CUDA IPC handle (sizeof(cudaIpcMemHandle_t) bytes) of local device
  // `ordinal`'s workspace.
  std::string export_workspace(int ordinal, std::string* handle);

  // Registers a device of this host driven by another process. Maps nothing
  // yet (connect_group maps it on the local devices that share a group with
  // it). Idempotent for the same (id, handle, PCI bus id); an error for the
  // same id with anything else, or for a local device's id. `data_bytes`:
  // the peer's data area, checked against ours (identical layouts are what
  // lets a kernel write a peer's region); -1 skips the check.
  std::string import_peer(int64_t global_id, const std::string& handle,
                          const std::string& pci_bus_id, int64_t data_bytes = -1);

  // Makes every member of the group `global_ids` reachable from each of its
  // local members: cudaDeviceEnablePeerAccess between local GPUs, and each
  // imported workspace opened in the local device's context
  // (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess; nothing more
  // for a peer on the same GPU). No cudaDeviceEnablePeerAccess towards
  // another process's GPU: that would create a context on it here. A pair
  // without a peer-to-peer path is an error naming both devices. Members
  // must be local or imported; a row without a local member does nothing.
  // Cheap on repeats (pairs done are cached). No CUDA call runs with the
  // table locked, so handlers on other threads go on meanwhile.
  std::string connect_group(const std::vector<int64_t>& global_ids);

  // Whether local (visible) CUDA device `ordinal` can read and write the GPU
  // at `pci_bus_id` directly (the same GPU: true). Needs no init. For a GPU
  // CUDA does not show this process, NVML answers; where NVML cannot either,
  // true (connect_group then tells for sure).
  static std::string can_access(int ordinal, const std::string& pci_bus_id, bool* out);

  // nullptr when the device is not a local one (not initialized, or remote).
  const DeviceState* by_ordinal(int ordinal) const;
  const DeviceState* by_global_id(int64_t id) const;

  // Workspace bases of the group members `ids[0..n)` as local device `self`
  // reaches them, into `out`; `*remote`: some member is another process's
  // GPU. On failure `*bad` is the index of the member that failed.
  MemberStatus member_workspaces(const DeviceState& self, const int64_t* ids, int n,
                                 char** out, int* bad, bool* remote) const;

  // Errors recorded by kernels and not yet cleared.
  std::vector<PendingError> pending_errors() const;

  // Waits until every local device finished all its work (XLA's included),
  // at most `timeout_s` in all. On a timeout the threads that wait for the
  // late devices stay blocked until they finish (BoundedWorker).
  std::string synchronize(double timeout_s);

  // synchronize(timeout_s), then zeroes every flag and line ([0,
  // kDataOffset)) and the error record of every device that finished. A
  // device that did not finish, or whose context has an error, is left as
  // it was and named in the message; the others are reset all the same.
  // Only this process's devices: with peers in other processes every process
  // must reset before any of them runs a pk_jax kernel again.
  std::string reset(double timeout_s);

 private:
  Runtime() = default;
  std::string connect_pair(const DeviceState& self, int64_t other_id, const DeviceState* local,
                           const PeerState* peer, char** mapped);
  std::string describe_device(int64_t global_id) const;
  PeerState* find_peer(int64_t id);
  const PeerState* find_peer(int64_t id) const;
  BoundedWorker& sync_worker(int ordinal);
  // The (ordinal, JAX id) and sync worker of every local device; false
  // before init.
  bool local_workers(std::vector<std::pair<int, int64_t>>* devices,
                     std::vector<BoundedWorker*>* workers);

  mutable std::mutex mu_;   // everything below
  std::mutex control_mu_;   // one init / reset at a time
  std::mutex connect_mu_;   // one connect_group at a time
  bool ready_ = false;
  size_t data_bytes_ = 0;
  std::vector<std::pair<int64_t, int>> init_devices_;  // as init was called, sorted
  std::vector<DeviceState> devices_;  // indexed by local ordinal; fixed once ready
  std::vector<PciId> visible_pci_;    // every visible CUDA device, by ordinal
  std::vector<std::unique_ptr<PeerState>> peers_;
  std::set<std::pair<int, int64_t>> connected_;  // (local ordinal, member global id)
  std::vector<std::unique_ptr<BoundedWorker>> sync_workers_;  // by local ordinal
};

// The error a kernel recorded on `d` and nobody cleared yet, or nullopt. The
// record is mapped host memory a kernel may write at any time: this is the
// one place that reads it.
std::optional<ErrorRecord> recorded_error(const DeviceState& d);

// Human-readable description of a kernel's error record.
std::string describe(const ErrorRecord& r, int ordinal);

}  // namespace pk::runtime
