// cpp/core/storage.h -- a device's block of memory, owned by the tensors (and queued tasks)
// that use it. CPU memory comes from a caching allocator, so the steady state of a training loop
// allocates nothing from the system; memory owned by someone else (a data batch, a DLPack
// producer) is wrapped with its own release function.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

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
};

// Bytes the CPU caching allocator holds in its free lists, and a way to give them back.
size_t cpu_cached_bytes();
void cpu_empty_cache();

}  // namespace mgpu
