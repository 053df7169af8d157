// Host checks of the runtime that need no GPU: PCI bus id parsing, the
// bounded waits of BoundedWorker (with a job that sleeps), and the runtime's
// error paths where CUDA finds no device (every call must return a message,
// leave the runtime uninitialized, and never crash). On a machine with GPUs
// the last part only checks what holds there too.
//
// Build and run (from the repository root; one command, split here):
//   g++ -std=c++17 -O1 -pthread -I csrc -I . -I /usr/local/cuda/include
//       tests/native/runtime_host_check.cc csrc/runtime/*.cc
//       -L /usr/local/cuda/lib64 -lcudart_static -ldl -lrt
//       -o /tmp/runtime_host_check && /tmp/runtime_host_check
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "runtime/bounded_worker.h"
#include "runtime/topology.h"
#include "runtime/workspace.h"

namespace rt = pk::runtime;
using namespace std::chrono_literals;

static int failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);          \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

static bool contains(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

static void check_pci() {
  auto a = rt::parse_pci_bus_id("0000:3B:00.0");
  CHECK(a && a->domain == 0 && a->bus == 0x3b && a->device == 0 && a->function == 0);
  auto b = rt::parse_pci_bus_id("00000000:3b:00.0");  // NVML's 8-digit domain
  CHECK(b && *a == *b);
  auto c = rt::parse_pci_bus_id("3b:00.0");
  CHECK(c && *c == *a);
  auto d = rt::parse_pci_bus_id(" 0001:c1:1f.7\n");
  CHECK(d && d->domain == 1 && d->bus == 0xc1 && d->device == 0x1f && d->function == 7);
  auto e = rt::parse_pci_bus_id("0000:3b:00");  // function 0
  CHECK(e && *e == *a);
  CHECK(!(*a != *b));
  CHECK(rt::format_pci_bus_id(*d) == "0001:c1:1f.7");
  CHECK(rt::parse_pci_bus_id(rt::format_pci_bus_id(*d)) == d);
  for (const char* bad : {"", "3b", "3b:00", "0000:3b:00.8", "0000:3b:20.0", "0000:3b:00.0x",
                          "000000000:3b:00.0", "0000:13b:00.0", "g000:3b:00.0", "0000:3b::0",
                          "0000:3b:00.0:1", "-1:3b:00.0"})
    CHECK(!rt::parse_pci_bus_id(bad));
  CHECK(rt::parse_pci_bus_id("0000:3b:00.0") != rt::parse_pci_bus_id("0000:3c:00.0"));
}

static void check_bounded_worker() {
  using Clock = rt::BoundedWorker::Clock;
  // A job that finishes: the result comes back, and each run covers the
  // requests made before it started.
  {
    int runs = 0;
    rt::BoundedWorker w([&] { ++runs; return runs == 2 ? std::string("second") : std::string(); });
    std::string msg = "x";
    CHECK(w.run(Clock::now() + 5s, &msg));
    CHECK(msg.empty());
    CHECK(w.run(Clock::now() + 5s, &msg));
    CHECK(msg == "second");
    CHECK(runs == 2);
  }
  // A job that blocks longer than the bound: the wait times out on time,
  // the job goes on; a second request while it is blocked times out too,
  // and once the job returns a new run covers it.
  {
    std::atomic<int> started{0};
    std::atomic<bool> release{false};
    rt::BoundedWorker w([&] {
      ++started;
      while (!release) std::this_thread::sleep_for(1ms);
      return std::string();
    });
    std::string msg = "untouched";
    const auto t0 = Clock::now();
    CHECK(!w.run(t0 + 100ms, &msg));
    const auto waited = Clock::now() - t0;
    CHECK(waited >= 100ms && waited < 2s);
    CHECK(msg == "untouched");
    CHECK(w.busy());
    const uint64_t ticket = w.request();  // made while the first run is blocked
    CHECK(!w.wait(ticket, Clock::now() + 50ms, &msg));
    release = true;
    CHECK(w.wait(ticket, Clock::now() + 5s, &msg));
    CHECK(msg.empty());
    // The ticket was requested during run 1, so run 1 cannot cover it.
    CHECK(started == 2);
  }
  // Several waiters at once share runs; nobody waits past its deadline.
  {
    std::atomic<int> runs{0};
    rt::BoundedWorker w([&] { ++runs; std::this_thread::sleep_for(20ms); return std::string(); });
    std::atomic<int> ok{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < 8; ++i)
      ts.emplace_back([&] { std::string m; ok += w.run(Clock::now() + 5s, &m); });
    for (auto& t : ts) t.join();
    CHECK(ok == 8);
    CHECK(runs >= 1 && runs <= 8);
  }
  // A worker destroyed while its job blocks: the thread finishes the job and
  // ends on its own (nothing here may hang or crash).
  {
    // The job owns what it reads: it outlives this scope.
    auto release = std::make_shared<std::atomic<bool>>(false);
    auto finished = std::make_shared<std::atomic<bool>>(false);
    auto w = std::make_unique<rt::BoundedWorker>([release, finished] {
      while (!*release) std::this_thread::sleep_for(1ms);
      *finished = true;
      return std::string();
    });
    std::string m;
    CHECK(!w->run(Clock::now() + 20ms, &m));
    w.reset();
    *release = true;
    for (int i = 0; i < 1000 && !*finished; ++i) std::this_thread::sleep_for(1ms);
    CHECK(*finished);
  }
}

static void check_runtime_without_gpu() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  cudaGetLastError();
  rt::Runtime& r = rt::Runtime::get();
  std::string handle;
  bool can = false;
  rt::DeviceInfo info;
  if (e == cudaSuccess && count > 0) {
    std::printf("note: %d CUDA device(s) here: only the checks that hold with GPUs run\n", count);
  } else {
    // Every call that needs CUDA returns its error as a message.
    const std::string init = r.init({{0, 0}}, 1 << 20, {});
    CHECK(contains(init, "pk_jax runtime: cudaGetDeviceCount"));
    CHECK(!r.initialized());
    CHECK(r.init({{0, 0}}, 1 << 20, {}) == init);  // a retry fails the same way, cleanly
    CHECK(!r.initialized());
    CHECK(contains(rt::Runtime::device_info(0, &info), "cudaGetDeviceCount"));
    CHECK(contains(rt::Runtime::can_access(0, "0000:3b:00.0", &can), "cudaGetDeviceCount"));
  }
  // Before init: the table calls refuse, the waits have nothing to wait for.
  CHECK(r.init({}, 1 << 20, {}) != "");
  CHECK(contains(r.export_workspace(0, &handle), "before init_runtime"));
  CHECK(contains(r.import_peer(1, std::string(64, 'x'), "0000:3b:00.0"), "before init_runtime"));
  CHECK(contains(r.connect_group({0, 1}), "before init_runtime"));
  CHECK(r.synchronize(1.0).empty());
  CHECK(r.reset(1.0).empty());
  CHECK(contains(r.synchronize(0.0), "timeout_s must be a positive"));
  CHECK(contains(r.reset(-1.0), "timeout_s must be a positive"));
  CHECK(contains(r.synchronize(1.0 / 0.0), "timeout_s must be a positive"));
  CHECK(r.pending_errors().empty());
  CHECK(r.by_ordinal(0) == nullptr);
  CHECK(r.by_global_id(0) == nullptr);
}

int main() {
  check_pci();
  check_bounded_worker();
  check_runtime_without_gpu();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("runtime host checks passed\n");
  return 0;
}
