// cpp/core/queue.h -- every device has one ordered queue of work: a worker thread. On a CPU device
// the thread computes; on a GPU it launches onto the device's compute stream (core/gpu.h), and
// waiting for a GPU task also waits for that stream. Ops enqueue a task and return at once, and
// the host waits only where it needs a result (numpy(), item(), waitall()). Tasks capture the
// tensors they use, so storage stays alive until every queued task that touches it has run.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/device.h"

namespace mgpu {

class Queue {
 public:
  static constexpr uint64_t kMaxPending = 256;

  explicit Queue(Device device);
  ~Queue();
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  Device device() const { return device_; }
  // Whether the calling thread is this queue's worker.
  bool on_worker_thread() const { return std::this_thread::get_id() == worker_.get_id(); }
  // Appends a task and returns its sequence number (1, 2, ...). `name` (a string literal) names
  // the op in error messages; `bytes` is the memory the task's outputs hold while it waits.
  // Blocks while kMaxPending tasks are waiting or while the waiting tasks hold more than the
  // byte budget (max_pending_bytes()), so a host loop cannot run far ahead of the device: each
  // queued op holds its activations' memory. A task always enters an empty queue, however big.
  // Callers must not hold the GIL (the bindings release it), since a finishing task may need it.
  uint64_t enqueue(const char* name, std::function<void()> fn, size_t bytes = 0);
  // Bytes the waiting tasks' outputs hold now, and the most they held since the last reset.
  size_t pending_bytes() const;
  size_t peak_pending_bytes(bool reset = false);
  // The sequence number of the newest task (0 when none was ever enqueued).
  uint64_t last_enqueued() const;
  // For a task on another queue that consumes this queue's results: waits until every task up to
  // `seq` has run (on a GPU: finished on its stream), then rethrows this queue's unreported
  // failure if it happened at or before `seq`, so a result computed from a failed op fails too
  // instead of silently reading garbage.
  void wait_done_or_rethrow(uint64_t seq);
  // Waits until every task enqueued so far has run (on a GPU: returned from its launch), and
  // raises nothing: a failure stays for the next wait that reports it. The fused step starts
  // with this, so no step's tensors are still held when the next one allocates its own.
  void drain();
  // Waits for all enqueued work, then raises the first error a task hit since the last call
  // (as the same exception kind, its message naming the op and the device).
  void synchronize();
  // For a running GPU task: `check` runs once the device has finished the task's kernels, at the
  // next wait on this queue (from the waiting thread); if it throws, the queue fails as if the
  // task had thrown. How a kernel's verdict (a bad label) reaches the host without stalling.
  void defer_check(std::function<void()> check);
  // While the worker captures a CUDA graph its kernels do not run, so their checks are kept for
  // the graph instead: begin_graph_checks() / end_graph_checks() (worker only) collect them, and
  // after every replay the launching task hands them back with defer_checks().
  struct DeferredCheck {
    const char* name;
    uint64_t seq;
    std::function<void()> fn;
  };
  void begin_graph_checks();
  std::vector<DeferredCheck> end_graph_checks();
  // How many of this queue's tasks have thrown so far (worker thread only): a capture compares
  // it at its start and end, and a graph whose capture saw a task fail is incomplete.
  uint64_t failed_tasks() const { return failed_tasks_; }
  void defer_checks(const std::vector<DeferredCheck>& checks);
  // A host thread capturing a CUDA graph on this device enqueues the capture's tasks between
  // begin_exclusive() and end_exclusive(); meanwhile enqueue() from any other thread waits, so
  // no other thread's op runs inside the capture (its launches and copies would be recorded
  // into the graph instead of run, and a copy's staging event would become a captured event).
  // begin_exclusive waits while another thread holds it.
  void begin_exclusive();
  void end_exclusive();
  // RAII form of the two.
  class Exclusive {
   public:
    explicit Exclusive(Queue& q) : q_(q) { q_.begin_exclusive(); }
    ~Exclusive() { q_.end_exclusive(); }
    Exclusive(const Exclusive&) = delete;
    Exclusive& operator=(const Exclusive&) = delete;

   private:
    Queue& q_;
  };

 private:
  struct Task {
    const char* name;
    std::function<void()> fn;
    size_t bytes;
    uint32_t label;  // the trace label of the enqueueing scope (core/trace.h); 0 when off
  };
  void run();
  // GPU queues: waits for the device's stream (a task's kernels may still be running after it
  // returned); throws DeviceError for a failed kernel. CPU queues: nothing to do.
  void finish_device_work();
  // Keeps the first error (wrapped to name the op and device) and returns the wrapped form.
  std::exception_ptr record_error(const char* name, uint64_t seq, std::exception_ptr e);

  Device device_;
  mutable std::mutex mutex_;
  std::condition_variable has_work_;
  std::condition_variable progressed_;
  std::deque<Task> tasks_;
  uint64_t enqueued_ = 0;
  uint64_t done_ = 0;
  size_t pending_bytes_ = 0;
  size_t peak_pending_bytes_ = 0;
  bool stopping_ = false;
  bool busy_ = false;
  std::exception_ptr error_;     // first failure not yet raised on the host
  std::vector<DeferredCheck> checks_;  // deferred checks of GPU tasks (guarded by mutex_)
  bool capturing_checks_ = false;      // worker thread only
  std::vector<DeferredCheck> graph_checks_;
  const char* running_name_ = "";  // the task the worker runs (worker thread only)
  uint64_t running_seq_ = 0;
  uint64_t failed_tasks_ = 0;      // worker thread only
  uint64_t error_seq_ = 0;       // the task that hit it
  bool exclusive_ = false;       // begin_exclusive() holds enqueue for exclusive_owner_ only
  std::thread::id exclusive_owner_;
  std::thread worker_;
};

// The byte budget of every queue's run-ahead: $MGPU_QUEUE_MAX_BYTES if set (bytes), else
// 64 MiB or an eighth of the machine's memory, whichever is smaller. Read once. Every byte of
// run-ahead is memory held on top of what the device works on (2 devices of ResNet-18's fused
// step: 256 MiB per queue raised the allocator's peak from 1161 to 1563 MiB), while a device
// needs little more than its next task queued: the host enqueues a layer in microseconds.
size_t max_pending_bytes();

// The error a failed task leaves: same exception kind (a bad label stays a ValueError, memory
// stays an OutOfMemoryError), its message prefixed with "<op> on <device> failed: ".
std::exception_ptr wrap_failure(const char* name, Device device, std::exception_ptr e);

// Held while enqueueing a collective (a set of tasks on several queues that wait for each
// other, as all-reduce's): every queue must receive the collectives of concurrent host threads
// in the same order, or two threads' halves could meet crosswise and wait for ever. Recursive,
// so a fused step may hold it around the all-reduce it enqueues.
std::recursive_mutex& collective_submission_mutex();

// The queue of a device (created on first use; check_device first for user input).
Queue& queue_of(Device device);

// A point in a queue's order: "every task enqueued so far".
struct Event {
  Queue* queue = nullptr;
  uint64_t seq = 0;
};
Event record_event(Device device);

// Waits for every device and raises the first pending error.
void waitall();

// How many CPU device queues are running tasks right now (for fair sharing of cores).
int busy_cpu_devices();

}  // namespace mgpu
