// Runtime: a local workspace exported as a CUDA IPC handle, and the
// workspaces of other processes' GPUs registered (mapped later, peers.cc).
#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "runtime/internal.h"

namespace pk::runtime {

using namespace internal;

namespace {

bool same_handle(const cudaIpcMemHandle_t& a, const cudaIpcMemHandle_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

}  // namespace

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

}  // namespace pk::runtime
