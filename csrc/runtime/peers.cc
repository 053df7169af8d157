// Runtime: the members of a group made reachable from each local member
// (peer access, imported workspaces opened in its context), whether two GPUs
// can reach each other, and the members' workspaces as a handler sees them.
#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <vector>

#include "runtime/internal.h"

namespace pk::runtime {

using namespace internal;

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

}  // namespace pk::runtime
