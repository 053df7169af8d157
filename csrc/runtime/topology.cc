#include "runtime/topology.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdio>
#include <mutex>

namespace pk::runtime {
namespace {

// Reads 1..max_digits hex digits at `p`; advances `p`.
bool read_hex(const char*& p, int max_digits, uint32_t* out) {
  uint32_t v = 0;
  int n = 0;
  while (n < max_digits && std::isxdigit(static_cast<unsigned char>(*p))) {
    const char c = char(std::tolower(static_cast<unsigned char>(*p)));
    v = v * 16 + uint32_t(c <= '9' ? c - '0' : c - 'a' + 10);
    ++p;
    ++n;
  }
  if (n == 0 || std::isxdigit(static_cast<unsigned char>(*p))) return false;
  *out = v;
  return true;
}

// The part of NVML this file uses (nvml.h is not part of the CUDA toolkit
// everywhere; these declarations are NVML's stable ABI).
using NvmlReturn = int;  // nvmlReturn_t: 0 is NVML_SUCCESS
using NvmlDevice = void*;  // nvmlDevice_t
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlP2pCapsRead = 0;   // NVML_P2P_CAPS_INDEX_READ
constexpr int kNvmlP2pCapsWrite = 1;  // NVML_P2P_CAPS_INDEX_WRITE
constexpr int kNvmlP2pStatusOk = 0;   // NVML_P2P_STATUS_OK

struct Nvml {
  NvmlReturn (*by_pci)(const char*, NvmlDevice*) = nullptr;  // nvmlDeviceGetHandleByPciBusId_v2
  NvmlReturn (*p2p)(NvmlDevice, NvmlDevice, int, int*) = nullptr;  // nvmlDeviceGetP2PStatus
  bool ok = false;
};

// Loaded once and kept (never nvmlShutdown: other users in the process may
// share the library's reference count).
const Nvml& nvml() {
  static Nvml n;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    auto init = reinterpret_cast<NvmlReturn (*)()>(dlsym(lib, "nvmlInit_v2"));
    n.by_pci = reinterpret_cast<decltype(n.by_pci)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    n.p2p = reinterpret_cast<decltype(n.p2p)>(dlsym(lib, "nvmlDeviceGetP2PStatus"));
    n.ok = init != nullptr && n.by_pci != nullptr && n.p2p != nullptr && init() == kNvmlSuccess;
  });
  return n;
}

}  // namespace

std::optional<PciId> parse_pci_bus_id(const std::string& text) {
  size_t b = text.find_first_not_of(" \t\r\n");
  size_t e = text.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return std::nullopt;
  const std::string s = text.substr(b, e - b + 1);
  // Count the colons to tell the forms apart.
  int colons = 0;
  for (char c : s) colons += c == ':';
  PciId id;
  const char* p = s.c_str();
  if (colons == 2) {
    if (!read_hex(p, 8, &id.domain) || *p++ != ':') return std::nullopt;
  } else if (colons != 1) {
    return std::nullopt;
  }
  if (!read_hex(p, 2, &id.bus) || *p++ != ':') return std::nullopt;
  if (!read_hex(p, 2, &id.device) || id.device > 0x1f) return std::nullopt;
  if (*p == '.') {
    ++p;
    if (!read_hex(p, 1, &id.function) || id.function > 7) return std::nullopt;
  } else if (colons != 2) {
    return std::nullopt;  // "bus:device" alone is ambiguous
  }
  if (*p != '\0') return std::nullopt;
  return id;
}

std::string format_pci_bus_id(const PciId& id) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%x", id.domain, id.bus, id.device, id.function);
  return buf;
}

std::optional<bool> nvml_p2p_read_write(const PciId& from, const PciId& to) {
  const Nvml& n = nvml();
  if (!n.ok) return std::nullopt;
  NvmlDevice a = nullptr, b = nullptr;
  if (n.by_pci(format_pci_bus_id(from).c_str(), &a) != kNvmlSuccess ||
      n.by_pci(format_pci_bus_id(to).c_str(), &b) != kNvmlSuccess)
    return std::nullopt;
  for (int index : {kNvmlP2pCapsRead, kNvmlP2pCapsWrite}) {
    int status = -1;
    if (n.p2p(a, b, index, &status) != kNvmlSuccess) return std::nullopt;
    if (status != kNvmlP2pStatusOk) return false;
  }
  return true;
}

}  // namespace pk::runtime
