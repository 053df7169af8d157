// A blocking job (cudaDeviceSynchronize) run on a thread of its own, so that
// callers can wait for it with a deadline.
//
// CUDA has no bounded wait for "everything on this device": XLA's streams are
// not ours to query, and cudaDeviceSynchronize has no timeout. A worker
// thread runs the job; a caller requests a run and waits for a run that
// started after its request, up to its deadline. On a timeout the worker stays
// blocked in the job (nothing can interrupt it) and later requests wait for it
// first: they time out as well until the job returns, then run it afresh.
// One thread per worker at most, started at the first request.
//
// Host only, no CUDA: tests/native/runtime_host_check.cc checks it with a job
// that sleeps.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace pk::runtime {

class BoundedWorker {
 public:
  using Clock = std::chrono::steady_clock;
  using Job = std::function<std::string()>;  // "" on success, else a message

  explicit BoundedWorker(Job job) : s_(std::make_shared<Shared>()) { s_->job = std::move(job); }
  BoundedWorker(const BoundedWorker&) = delete;
  BoundedWorker& operator=(const BoundedWorker&) = delete;

  // The thread ends once it is idle (or once the job in flight returns).
  ~BoundedWorker() {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
    s_->cv.notify_all();
  }

  // Asks for a run. Use with wait(): request every worker first, then wait for
  // each, so that the jobs of several workers run at the same time.
  uint64_t request() {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!s_->thread_started) {
      s_->thread_started = true;
      std::thread(&BoundedWorker::loop, s_).detach();
    }
    const uint64_t ticket = ++s_->requested;
    s_->cv.notify_all();
    return ticket;
  }

  // Waits until a run that started at or after `ticket` was requested has
  // finished, or until `deadline`. True when it finished; `message` is that
  // run's result ("" on success). False on a timeout (`message` untouched).
  bool wait(uint64_t ticket, Clock::time_point deadline, std::string* message) {
    std::unique_lock<std::mutex> lock(s_->mu);
    if (!s_->cv.wait_until(lock, deadline, [&] { return s_->covered >= ticket; })) return false;
    *message = s_->result;
    return true;
  }

  bool run(Clock::time_point deadline, std::string* message) {
    return wait(request(), deadline, message);
  }

  // True while a run is in progress (a timed-out job still blocked included).
  bool busy() const {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->running;
  }

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    Job job;
    uint64_t requested = 0;  // tickets handed out
    uint64_t covered = 0;    // every ticket <= this has a finished run
    std::string result;      // of the last finished run
    bool running = false;
    bool thread_started = false;
    bool stop = false;
  };

  // Owns a reference to the shared state: the thread outlives the worker if
  // the job is blocked when the worker goes away.
  static void loop(std::shared_ptr<Shared> s) {
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      s->cv.wait(lock, [&] { return s->stop || s->requested > s->covered; });
      if (s->stop) return;
      const uint64_t target = s->requested;  // this run covers every request so far
      s->running = true;
      lock.unlock();
      std::string r = s->job();
      lock.lock();
      s->running = false;
      s->result = std::move(r);
      s->covered = target;
      s->cv.notify_all();
    }
  }

  std::shared_ptr<Shared> s_;
};

}  // namespace pk::runtime
