// cpp/comm/barrier.h -- the reusable barrier at which the device threads of one in-process
// collective meet (CPU devices' and GPUs' all-reduce). An early thread spins briefly (yielding)
// before it sleeps: the devices of one step arrive within microseconds, and a condition-variable
// wake-up costs tens of microseconds. abort() releases everyone with an exception, so a device
// whose part failed leaves neither the others nor the host waiting on their queues blocked.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/trace.h"

namespace mgpu::comm {

class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}

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
    cv_.wait(lock, [&] {
      return generation_.load(std::memory_order_acquire) != gen ||
             aborted_.load(std::memory_order_acquire);
    });
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
  [[noreturn]] static void throw_aborted() {
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
};

}  // namespace mgpu::comm
