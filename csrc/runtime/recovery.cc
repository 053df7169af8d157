// Runtime: the bounded wait for every local device (synchronize) and the
// reset of their flags and error records after a failure (reset).
#include "runtime/workspace.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/internal.h"

namespace pk::runtime {

using namespace internal;

namespace {

std::string check_timeout(double timeout_s) {
  if (!(timeout_s > 0) || !std::isfinite(timeout_s))
    return "pk_jax runtime: timeout_s must be a positive number of seconds, got " +
           std::to_string(timeout_s);
  return "";
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

}  // namespace

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

}  // namespace pk::runtime
