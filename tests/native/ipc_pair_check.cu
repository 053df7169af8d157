// GPU check of the runtime across two processes of one host (needs a GPU;
// not run by the CPU test suite): the process forks before any CUDA call,
// parent and child each init the runtime on one device (JAX ids 0 and 1),
// exchange (workspace handle, PCI bus id, data bytes) through pipes, import
// each other, connect the group {0, 1}, then write into the other's workspace
// from a kernel and by a copy, and read back what the other wrote into their
// own. Also: import/connect idempotency and refusals, can_access,
// synchronize's bound (a kernel that spins longer than the timeout), reset.
//
// Both processes on one GPU (the default: ordinals 0 0) is how one GPU
// tests the cross-process path; with two GPUs pass "0 1".
//
// Build and run (from the repository root; one command, split here):
//   nvcc -std=c++17 -O1 -gencode=arch=compute_90a,code=sm_90a -I csrc -I .
//        tests/native/ipc_pair_check.cu csrc/runtime/*.cc
//        -o /tmp/ipc_pair_check && /tmp/ipc_pair_check 0 0
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/workspace.h"

namespace rt = pk::runtime;

static int failures = 0;
static int role = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::printf("[process %d] FAIL %s:%d: %s\n", role, __FILE__, __LINE__, #cond); \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

#define CHECK_OK(expr)                                                                      \
  do {                                                                                      \
    const std::string m_ = (expr);                                                          \
    if (!m_.empty()) {                                                                      \
      std::printf("[process %d] FAIL %s:%d: %s: %s\n", role, __FILE__, __LINE__, #expr,     \
                  m_.c_str());                                                              \
      ++failures;                                                                           \
    }                                                                                       \
  } while (0)

static bool contains(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

static void write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w <= 0) std::exit(3);
    c += w;
    n -= size_t(w);
  }
}

static void read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r <= 0) std::exit(4);
    c += r;
    n -= size_t(r);
  }
}

// What one process tells the other.
struct Card {
  char handle[sizeof(cudaIpcMemHandle_t)];
  char pci[64];
  int64_t data_bytes;
};

__global__ void put(uint64_t* dst, uint64_t value) {
  // A system-scope release store, as the kernels signal.
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(dst), "l"(value) : "memory");
}

__global__ void spin_ns(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

static int run(int ordinal, int to_peer, int from_peer) {
  const int64_t self_id = role;
  const int64_t peer_id = 1 - role;
  const size_t data_bytes = size_t(1) << 20;
  rt::Runtime& r = rt::Runtime::get();

  rt::DeviceInfo info;
  if (std::string err = rt::Runtime::device_info(ordinal, &info); !err.empty()) {
    std::printf("[process %d] needs a GPU: %s\n", role, err.c_str());
    return 1;
  }
  CHECK(info.supported);
  CHECK(info.ipc);
  CHECK_OK(r.init({{self_id, ordinal}}, data_bytes, {}));
  CHECK(r.initialized());
  CHECK_OK(r.init({{self_id, ordinal}}, data_bytes, {}));  // same arguments: a no-op
  CHECK(contains(r.init({{self_id, ordinal}}, data_bytes * 2, {}), "already initialized"));
  const rt::DeviceState* self = r.by_ordinal(ordinal);
  CHECK(self != nullptr && self->global_id == self_id);
  if (self == nullptr) return 1;

  Card mine{};
  std::string handle;
  CHECK_OK(r.export_workspace(ordinal, &handle));
  CHECK(handle.size() == sizeof(cudaIpcMemHandle_t));
  std::string again;
  CHECK_OK(r.export_workspace(ordinal, &again));
  CHECK(again == handle);
  std::memcpy(mine.handle, handle.data(), sizeof(mine.handle));
  std::snprintf(mine.pci, sizeof(mine.pci), "%s", info.pci_bus_id.c_str());
  mine.data_bytes = int64_t(data_bytes);
  write_all(to_peer, &mine, sizeof(mine));
  Card theirs{};
  read_all(from_peer, &theirs, sizeof(theirs));
  const std::string their_handle(theirs.handle, sizeof(theirs.handle));

  // Refusals before the import.
  CHECK(contains(r.import_peer(self_id, their_handle, theirs.pci), "driven by this process"));
  CHECK(contains(r.import_peer(peer_id, handle, theirs.pci), "own workspace"));
  CHECK(contains(r.import_peer(peer_id, their_handle, theirs.pci, 5), "same pk_jax.configure"));
  CHECK(contains(r.import_peer(peer_id, their_handle.substr(1), theirs.pci), "bytes, got"));
  CHECK(contains(r.import_peer(peer_id, their_handle, "nonsense"), "cannot parse"));
  CHECK(contains(r.connect_group({0, 1}), "is not known to this process"));
  int bad = -1;
  bool remote = false;
  char* ws[2] = {};
  const int64_t ids[2] = {0, 1};
  CHECK(r.member_workspaces(*self, ids, 2, ws, &bad, &remote) == rt::MemberStatus::kUnknown);

  CHECK_OK(r.import_peer(peer_id, their_handle, theirs.pci, theirs.data_bytes));
  CHECK_OK(r.import_peer(peer_id, their_handle, theirs.pci));  // idempotent
  std::string other = their_handle;
  other[10] ^= 1;
  CHECK(contains(r.import_peer(peer_id, other, theirs.pci), "already imported"));
  CHECK(r.member_workspaces(*self, ids, 2, ws, &bad, &remote) == rt::MemberStatus::kNotConnected);
  CHECK(bad == peer_id);

  bool can = false;
  CHECK_OK(rt::Runtime::can_access(ordinal, theirs.pci, &can));
  CHECK(can);
  CHECK_OK(r.connect_group({0, 1}));
  CHECK_OK(r.connect_group({1, 0}));  // cached
  CHECK(contains(r.connect_group({0, 0}), "appears twice"));
  CHECK(r.member_workspaces(*self, ids, 2, ws, &bad, &remote) == rt::MemberStatus::kOk);
  CHECK(ws[self_id] == self->workspace);
  CHECK(ws[peer_id] != nullptr && ws[peer_id] != self->workspace);
  CHECK(remote);

  // Each writes into the other's data area: a kernel store at word `role`, a
  // copy at word 2 + role. Then each reads its own.
  uint64_t* peer_data = reinterpret_cast<uint64_t*>(ws[peer_id] + pk::kDataOffset);
  uint64_t* own_data = reinterpret_cast<uint64_t*>(self->workspace + pk::kDataOffset);
  CHECK(cudaSetDevice(ordinal) == cudaSuccess);
  put<<<1, 1>>>(peer_data + role, 1000 + role);
  const uint64_t copied = 2000 + role;
  CHECK(cudaMemcpy(peer_data + 2 + role, &copied, 8, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  char byte = 1;
  write_all(to_peer, &byte, 1);  // our writes are done
  read_all(from_peer, &byte, 1);  // theirs too
  uint64_t seen[4] = {};
  CHECK(cudaMemcpy(seen, own_data, sizeof(seen), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(seen[peer_id] == uint64_t(1000 + peer_id));
  CHECK(seen[2 + peer_id] == uint64_t(2000 + peer_id));

  // synchronize is bounded: a kernel that spins 3 s outlives a 0.5 s bound.
  CHECK_OK(r.synchronize(5.0));
  spin_ns<<<1, 1>>>(3000000000ull);
  const std::string late = r.synchronize(0.5);
  CHECK(contains(late, "did not finish within 0.5 s"));
  CHECK_OK(r.synchronize(20.0));

  // reset zeroes the flags (not the data area).
  const uint32_t marker = 0xabcdef;
  CHECK(cudaMemcpy(self->workspace + 4096, &marker, 4, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK_OK(r.reset(10.0));
  uint32_t after = 1;
  CHECK(cudaMemcpy(&after, self->workspace + 4096, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(after == 0);
  CHECK(r.pending_errors().empty());

  write_all(to_peer, &byte, 1);  // keep both mappings alive until both are done
  read_all(from_peer, &byte, 1);
  std::printf("[process %d] %s\n", role, failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}

int main(int argc, char** argv) {
  const int ordinals[2] = {argc > 1 ? std::atoi(argv[1]) : 0, argc > 2 ? std::atoi(argv[2]) : 0};
  int a[2], b[2];  // a: parent -> child, b: child -> parent
  if (pipe(a) != 0 || pipe(b) != 0) return 2;
  // Fork before any CUDA call: a child cannot use a CUDA its parent set up.
  const pid_t pid = fork();
  if (pid < 0) return 2;
  if (pid == 0) {
    role = 1;
    close(a[1]);
    close(b[0]);
    std::exit(run(ordinals[1], b[1], a[0]));
  }
  close(a[0]);  // so that a process that dies ends the other's reads (EOF)
  close(b[1]);
  const int rc = run(ordinals[0], a[1], b[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::printf("ipc pair check %s\n", rc == 0 && child_ok ? "passed" : "FAILED");
  return rc == 0 && child_ok ? 0 : 1;
}
