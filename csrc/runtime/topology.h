// Which GPU is which, across processes of one host: PCI bus ids (the name a
// GPU has in every process, whatever CUDA_VISIBLE_DEVICES says) and the
// peer-to-peer questions that CUDA cannot answer for a GPU this process does
// not see (NVML, loaded at run time if present).
//
// Host only; no CUDA call in here, so tests/native/runtime_host_check.cc can
// check it without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace pk::runtime {

// A PCI address, domain:bus:device.function.
struct PciId {
  uint32_t domain = 0;
  uint32_t bus = 0;
  uint32_t device = 0;
  uint32_t function = 0;
  bool operator==(const PciId& o) const {
    return domain == o.domain && bus == o.bus && device == o.device && function == o.function;
  }
  bool operator!=(const PciId& o) const { return !(*this == o); }
};

// Parses the forms CUDA and NVML print, in hexadecimal, either case:
// "domain:bus:device.function" (domain of 4 or 8 digits, as
// cudaDeviceGetPCIBusId / nvidia-smi write it), "domain:bus:device"
// (function 0) and "bus:device.function" (domain 0). Surrounding blanks are
// ignored. nullopt for anything else.
std::optional<PciId> parse_pci_bus_id(const std::string& text);

// "0000:3b:00.0": the form cudaDeviceGetPCIBusId writes (lower case).
std::string format_pci_bus_id(const PciId& id);

// NVML's answer to "can the GPU at `from` read and write the GPU at `to`
// directly", for GPUs CUDA does not show this process. nullopt when NVML is
// missing or does not know one of them (a container that mounts only some
// GPUs).
std::optional<bool> nvml_p2p_read_write(const PciId& from, const PciId& to);

}  // namespace pk::runtime
