// cpp/comm/barrier.h -- the reusable barrier at which the device threads of one in-process
// collective meet (CPU devices' and GPUs' all-reduce). An early thread spins briefly (yielding)
// before it sleeps: the devices of one step arrive within microseconds, and a condition-variable
// wake-up costs tens of microseconds. abort() releases everyone with an exception, so a device
// whose part failed leaves neither the others nor the host waiting on their queues blocked.
// set_deadline() bounds the wait: a part that never arrives (its queue is blocked) then ends
// every waiter's part with DeviceError instead of a hang.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "core/error.h"
#include "core/trace.h"

namespace mgpu::comm {

class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}

  // From now on a wait longer than `seconds` aborts the barrier: that wait, the others it
  // releases and every later one throw DeviceError with `why` (which names the collective and
  // what to do). Set before any thread waits.
  void set_deadline(double seconds, std::string why) {
    deadline_s_ = seconds;
    why_ = std::move(why);
  }

  void arrive_and_wait() {
    trace::Span span("wait for peers");
    const int gen = generation_.load(std::memory_order_acquire);
    if (aborted_.load(std::memory_order_acquire)) throw_aborted();
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release below
      {
        std::lock_guard<std::mutex> lock(mutex_);
        generation_.fetch_add(1, std::memory_order_release);
      }
      cv_.notify_all();
      return;
    }
    for (int i = 0; i < kSpins; ++i) {
      if (generation_.load(std::memory_order_acquire) != gen) return;
      if (aborted_.load(std::memory_order_acquire)) throw_aborted();
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    auto passed = [&] {
      return generation_.load(std::memory_order_acquire) != gen ||
             aborted_.load(std::memory_order_acquire);
    };
    if (deadline_s_ > 0) {
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(deadline_s_));
      if (!cv_.wait_until(lock, until, passed)) {
        timed_out_.store(true, std::memory_order_release);
        aborted_.store(true, std::memory_order_release);
        lock.unlock();
        cv_.notify_all();
        throw_aborted();
      }
    } else {
      cv_.wait(lock, passed);
    }
    if (generation_.load(std::memory_order_acquire) == gen) throw_aborted();
  }

  void abort() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

 private:
  // Every part released by a passed deadline (and every late one) says why.
  [[noreturn]] void throw_aborted() const {
    if (timed_out_.load(std::memory_order_acquire)) throw DeviceError(why_);
    throw DeviceError("allreduce: another device's part of this all-reduce failed (its error is "
                      "raised too)");
  }
  static constexpr int kSpins = 2000;  // a few tens of microseconds of yields
  const int count_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> timed_out_{false};
  double deadline_s_ = 0;  // 0: wait for ever
  std::string why_;
};

}  // namespace mgpu::comm
