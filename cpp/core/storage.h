// cpp/core/storage.h -- a device's block of memory, owned by the tensors (and queued tasks)
// that use it. CPU memory comes from a caching allocator, so the steady state of a training loop
// allocates nothing from the system; memory owned by someone else (a data batch, a DLPack
// producer) is wrapped with its own release function.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "core/device.h"

namespace mgpu {

class Storage {
 public:
  // Allocates nbytes (64-byte aligned) on the device, from the device's cache when it can.
  static std::shared_ptr<Storage> allocate(Device device, size_t nbytes);
  // Wraps memory owned elsewhere; release() runs when the last user is gone (on any thread).
  static std::shared_ptr<Storage> wrap(Device device, void* data, size_t nbytes,
                                       std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  Device device() const { return device_; }
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

  // The autograd version counter, shared by every view of this memory: each in-place change
  // bumps it, and backward refuses a saved tensor whose version moved (as PyTorch does).
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  // Sticky failures. Memory from allocate() holds garbage until its first task writes it, so
  // the first task that touches a fresh block is its producer: claim_fresh() says whether the
  // caller is that task (once). If the producer fails, fail() keeps its error here and every
  // later read or op on the tensor raises it again, instead of only the first wait.
  bool claim_fresh() { return fresh_.exchange(false, std::memory_order_relaxed); }
  void mark_written() { fresh_.store(false, std::memory_order_relaxed); }
  void fail(std::exception_ptr error) {
    int expect = 0;
    if (!state_.compare_exchange_strong(expect, 1, std::memory_order_acquire)) return;
    error_ = std::move(error);
    state_.store(2, std::memory_order_release);
  }
  // The kept failure, or null.
  std::exception_ptr error() const {
    return state_.load(std::memory_order_acquire) == 2 ? error_ : nullptr;
  }

  // Whether any task was ever enqueued with this memory. Until then only the host wrote it (a
  // NumPy array's copy, a data batch), so the host may read it without waiting for a queue.
  void note_queued() {
    if (!queued_.load(std::memory_order_relaxed)) queued_.store(true, std::memory_order_relaxed);
  }
  bool queued() const { return queued_.load(std::memory_order_relaxed); }

 private:
  Storage(Device device, void* data, size_t nbytes, size_t capacity,
          std::function<void()> release)
      : device_(device), data_(data), nbytes_(nbytes), capacity_(capacity),
        release_(std::move(release)) {}
  Device device_;
  void* data_;
  size_t nbytes_;
  size_t capacity_;  // size of the cached block (0 for wrapped memory)
  std::function<void()> release_;
  std::atomic<uint64_t> version_{0};
  std::atomic<bool> fresh_{true};
  std::atomic<bool> queued_{false};
  std::atomic<int> state_{0};  // 0 fine, 1 being failed, 2 failed (error_ set)
  std::exception_ptr error_;
};

// "1.5 GiB (1610612736 bytes)".
std::string describe_bytes(size_t n);

// The CPU caching allocator has two parts (storage.cpp): blocks up to 1 MiB come in size classes,
// each with its free list; larger blocks are cut from an arena of big segments (best fit, split,
// merged with free neighbours on release), their sizes rounded to 64 KiB.
// Bytes the CPU caching allocator holds in its free lists, and a way to give them back.
size_t cpu_cached_bytes();
// The CPU caching allocator's counters (every CPU device shares it), in bytes of rounded block
// sizes: allocated (live blocks), cached (free lists), peak_allocated (the most live at once since
// the start or the last reset), system_mallocs / system_bytes (blocks or arena segments and bytes
// taken from the system so far: flat once a training loop reaches its steady state).
struct CpuMemoryStats {
  size_t allocated = 0, cached = 0, peak_allocated = 0, system_mallocs = 0, system_bytes = 0;
};
CpuMemoryStats cpu_memory_stats();
// peak_allocated becomes allocated (to measure the peak of what follows).
void cpu_reset_peak_memory();
// Steady state without a race: between trace_begin and trace_end the allocator records, per
// size class, how many blocks a step may need: for large classes (over 64 KiB) the most live at
// once (on every thread: the step's peak, including blocks that outlive it such as gradients),
// for small ones every request. cpu_reserve then makes sure each large class holds at least
// that many blocks, live or on its free list, and each small class that many free blocks. Later
// identical steps find a free block for every request, and for large blocks the cache holds the
// step's peak per class instead of a block for every request. Arena sizes are left out of
// cpu_reserve: the arena keeps every segment the traced step took.
void cpu_trace_begin();
std::map<size_t, size_t> cpu_trace_end();
void cpu_reserve(const std::map<size_t, size_t>& blocks);
void cpu_empty_cache();

}  // namespace mgpu
