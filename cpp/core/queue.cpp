// cpp/core/queue.cpp -- the CPU device worker thread and the device registry.
#include "core/queue.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <stdexcept>

#include "core/error.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "core/trace.h"

namespace mgpu {
namespace {

std::atomic<int> g_busy_cpu{0};

struct Registry {
  std::mutex mutex;
  std::map<Device, std::unique_ptr<Queue>> queues;
};

Registry& registry() {
  // Never destroyed: worker threads may still hold storage when static destructors run, and
  // joining threads during interpreter shutdown is a classic hang.
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

int busy_cpu_devices() { return g_busy_cpu.load(std::memory_order_relaxed); }

Queue::Queue(Device device) : device_(device) { worker_ = std::thread([this] { run(); }); }

Queue::~Queue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  has_work_.notify_all();
  if (worker_.joinable()) worker_.join();
}

uint64_t Queue::enqueue(const char* name, std::function<void()> fn, size_t bytes) {
  static const size_t budget = max_pending_bytes();
  uint64_t seq;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Safe to wait: every queued task depends only on work enqueued before it, which is all
    // already in some queue, so the backlog always drains (collectives are enqueued in one
    // order everywhere, see collective_submission_mutex).
    auto room = [&] {
      return enqueued_ - done_ < kMaxPending &&
             (pending_bytes_ == 0 || pending_bytes_ + bytes <= budget);
    };
    // Another thread's capture of a CUDA graph on this device must not take this task in.
    const std::thread::id me = std::this_thread::get_id();
    auto admitted = [&] { return !exclusive_ || exclusive_owner_ == me; };
    if (!admitted()) {
      trace::Span waiting("capture", [&] { return "wait for a capture on " + device_.str(); });
      progressed_.wait(lock, admitted);
    }
    if (!room()) {
      trace::Span waiting("queue full", [&] { return "wait for room on " + device_.str(); });
      progressed_.wait(lock, [&] { return room() && admitted(); });
    }
    tasks_.push_back(Task{name, std::move(fn), bytes, trace::on() ? trace::current_label() : 0});
    pending_bytes_ += bytes;
    if (pending_bytes_ > peak_pending_bytes_) peak_pending_bytes_ = pending_bytes_;
    seq = ++enqueued_;
  }
  has_work_.notify_one();
  return seq;
}

size_t Queue::pending_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_bytes_;
}

size_t Queue::peak_pending_bytes(bool reset) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t peak = peak_pending_bytes_;
  if (reset) peak_pending_bytes_ = pending_bytes_;
  return peak;
}

uint64_t Queue::last_enqueued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enqueued_;
}

void Queue::wait_done_or_rethrow(uint64_t seq) {
  trace::Span waiting("wait", [&] { return "wait for " + device_.str(); });
  {
    std::unique_lock<std::mutex> lock(mutex_);
    progressed_.wait(lock, [&] { return done_ >= seq; });
    if (error_ && error_seq_ <= seq) std::rethrow_exception(error_);
  }
  finish_device_work();
}

void Queue::drain() {
  trace::Span waiting("wait", [&] { return "drain " + device_.str(); });
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = enqueued_;
  progressed_.wait(lock, [&] { return done_ >= target; });
}

void Queue::synchronize() {
  uint64_t target;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    target = enqueued_;
    progressed_.wait(lock, [&] { return done_ >= target; });
  }
  try {
    finish_device_work();
  } catch (...) {
    record_error("a kernel", target, std::current_exception());
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
    error_seq_ = 0;
  }
  if (error) std::rethrow_exception(error);
}

void Queue::finish_device_work() {
  // A GPU task returns once its kernels are launched; they finish on the device's stream.
  if (device_.is_cpu()) return;
  std::vector<DeferredCheck> checks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checks.swap(checks_);  // taken before the wait: their kernels are all behind it
  }
  gpu::synchronize(device_.index);
  std::exception_ptr first;
  for (DeferredCheck& c : checks) {
    try {
      c.fn();
    } catch (...) {
      std::exception_ptr wrapped = record_error(c.name, c.seq, std::current_exception());
      if (!first) first = wrapped;
    }
  }
  if (first) std::rethrow_exception(first);
}

void Queue::defer_check(std::function<void()> check) {
  if (capturing_checks_) {
    graph_checks_.push_back(DeferredCheck{running_name_, running_seq_, std::move(check)});
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  checks_.push_back(DeferredCheck{running_name_, running_seq_, std::move(check)});
}

void Queue::begin_graph_checks() {
  capturing_checks_ = true;
  graph_checks_.clear();
}

std::vector<Queue::DeferredCheck> Queue::end_graph_checks() {
  capturing_checks_ = false;
  return std::move(graph_checks_);
}

void Queue::defer_checks(const std::vector<DeferredCheck>& checks) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const DeferredCheck& c : checks)
    checks_.push_back(DeferredCheck{c.name, running_seq_, c.fn});
}

void Queue::begin_exclusive() {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::thread::id me = std::this_thread::get_id();
  MGPU_ASSERT(!(exclusive_ && exclusive_owner_ == me), device_.str(),
              ": this thread already holds the queue for a capture");
  progressed_.wait(lock, [&] { return !exclusive_; });
  exclusive_ = true;
  exclusive_owner_ = me;
}

void Queue::end_exclusive() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    exclusive_ = false;
    exclusive_owner_ = std::thread::id();
  }
  progressed_.notify_all();
}

std::exception_ptr Queue::record_error(const char* name, uint64_t seq, std::exception_ptr e) {
  std::exception_ptr wrapped = wrap_failure(name, device_, e);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) {  // the first error explains the rest
    error_ = wrapped;
    error_seq_ = seq;
  }
  return wrapped;
}

std::exception_ptr wrap_failure(const char* name, Device device, std::exception_ptr e) {
  // Keep the exception's kind (a bad label is still a ValueError) but say where it happened:
  // by the time the host sees it, the call that enqueued the op has long returned.
  std::string where = std::string(name) + " on " + device.str() + " failed: ";
  std::exception_ptr wrapped;
  try {
    std::rethrow_exception(e);
  } catch (const ValueError& x) {
    wrapped = std::make_exception_ptr(ValueError(where + x.what()));
  } catch (const TypeError& x) {
    wrapped = std::make_exception_ptr(TypeError(where + x.what()));
  } catch (const std::out_of_range& x) {
    wrapped = std::make_exception_ptr(IndexError(where + x.what()));
  } catch (const std::invalid_argument& x) {
    wrapped = std::make_exception_ptr(ValueError(where + x.what()));
  } catch (const OutOfMemoryError& x) {
    wrapped = std::make_exception_ptr(OutOfMemoryError(where + x.what()));
  } catch (const std::bad_alloc&) {
    wrapped = std::make_exception_ptr(
        OutOfMemoryError(where + "out of memory (a host allocation of unknown size failed)"));
  } catch (const std::exception& x) {
    wrapped = std::make_exception_ptr(DeviceError(where + x.what()));
  } catch (...) {
    wrapped = std::make_exception_ptr(DeviceError(where + "unknown error"));
  }
  return wrapped;
}

size_t max_pending_bytes() {
  static const size_t budget = [] {
    if (const char* env = std::getenv("MGPU_QUEUE_MAX_BYTES")) {
      char* end = nullptr;
      unsigned long long v = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0' && v > 0) return static_cast<size_t>(v);
    }
    size_t limit = size_t{64} << 20;
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) limit = std::min(limit, static_cast<size_t>(pages) * page / 8);
    return limit;
  }();
  return budget;
}

std::recursive_mutex& collective_submission_mutex() {
  static std::recursive_mutex* m = new std::recursive_mutex;  // never destroyed, as the registry
  return *m;
}

// Collectives run on the device's worker too, but the timeline shows them on the device's
// communication track, so their overlap with compute (or the lack of it) is visible.
static bool is_collective(const char* name) {
  return std::strncmp(name, "allreduce", 9) == 0 || std::strncmp(name, "distributed.", 12) == 0;
}

void Queue::run() {
  block_async_signals();
  // The timeline's tracks of this worker: what runs here ("gpu(0)": on a GPU the host-side
  // launches, which on the emulator include the kernels' execution) and its collectives.
  trace::set_thread_track(device_.str());
  const uint32_t compute_track = trace::thread_track();
  const uint32_t comm_track = trace::intern(device_.str() + " comm");
  // A GPU's worker makes its device current once: every task it runs launches there.
  std::exception_ptr start_error;
  if (!device_.is_cpu()) {
    try {
      gpu::set_device(device_.index);
      gpu::compute_stream(device_.index);
    } catch (...) {
      start_error = std::current_exception();
    }
  }
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (tasks_.empty() && busy_) {
        busy_ = false;
        if (device_.is_cpu()) g_busy_cpu.fetch_sub(1, std::memory_order_relaxed);
      }
      has_work_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      if (!busy_) {
        busy_ = true;
        if (device_.is_cpu()) g_busy_cpu.fetch_add(1, std::memory_order_relaxed);
      }
    }
    running_name_ = task.name;
    running_seq_ = done_ + 1;
    const bool tracing = trace::on();
    int64_t t0 = 0;
    uint32_t track = compute_track;
    if (tracing) {
      track = is_collective(task.name) ? comm_track : compute_track;
      trace::set_thread_track_id(track);
      t0 = trace::now_ns();
    }
    try {
      if (start_error) std::rethrow_exception(start_error);
      task.fn();
    } catch (...) {
      ++failed_tasks_;
      record_error(task.name, done_ + 1, std::current_exception());
    }
    if (tracing) {
      trace::record(track, task.name, task.label, t0, trace::now_ns(), true);
      trace::set_thread_track_id(compute_track);
    }
    // Drop the captured tensors before announcing completion, so a host that waited for this
    // task sees their storage released (and wrapped memory handed back) already.
    task.fn = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++done_;
      pending_bytes_ -= task.bytes;
    }
    progressed_.notify_all();
  }
}

Queue& queue_of(Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& q = r.queues[device];
  if (!q) q = std::make_unique<Queue>(device);
  return *q;
}

Event record_event(Device device) {
  Queue& q = queue_of(device);
  return Event{&q, q.last_enqueued()};
}

void waitall() {
  std::vector<Queue*> all;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& [d, q] : r.queues) all.push_back(q.get());
  }
  // Wait for all before raising, so no device is still running when the error surfaces.
  std::exception_ptr first;
  for (Queue* q : all) {
    try {
      q->synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace mgpu
