// cpp/core/tensor.h -- a contiguous, row-major view of a Storage: shape, dtype, byte offset.
// Tensors are cheap handles (copying one shares the storage). Views (reshape, row slices) share
// memory with their base; everything else allocates. Work on a tensor's data happens on its
// device's queue (see queue.h); the accessors here hand out raw pointers for those tasks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/shape.h"
#include "core/storage.h"

namespace mgpu {

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory of the given shape on the device (nothing is enqueued).
  static Tensor empty(const Shape& shape, DType dtype, Device device);
  static Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }
  // A tensor over existing storage (offset in bytes).
  Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, int64_t offset = 0);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t axis) const { return shape_.at(axis < 0 ? axis + dim() : axis); }
  int64_t numel() const { return mgpu::numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_->device(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  int64_t offset() const { return offset_; }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* data() const {
    MGPU_ASSERT(dtype_ == dtype_of<T>(), "tensor is ", dtype_name(dtype_));
    return static_cast<T*>(raw());
  }
  float* f32() const { return data<float>(); }

  // Same memory, new shape; one extent may be -1 (inferred).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along axis 0, sharing memory.
  Tensor slice_rows(int64_t begin, int64_t end) const;

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_;
  DType dtype_ = DType::F32;
  int64_t offset_ = 0;
};

std::string describe(const Tensor& t);  // "float32 tensor of shape (2, 3) on cpu(0)"

// Throws ValueError unless every tensor is on the same device.
void require_same_device(const char* op, std::initializer_list<const Tensor*> tensors);
// Throws TypeError unless t has dtype `want`.
void require_dtype(const char* op, const char* name, const Tensor& t, DType want);

// Enqueues fn on the device's queue, keeping `keep` alive until it has run.
template <typename Fn, typename... Keep>
void enqueue_on(Device device, const char* name, Fn&& fn, const Keep&... keep);

}  // namespace mgpu

#include "core/queue.h"

namespace mgpu {
template <typename Fn, typename... Keep>
void enqueue_on(Device device, const char* name, Fn&& fn, const Keep&... keep) {
  queue_of(device).enqueue(name, [fn = std::forward<Fn>(fn), keep...]() mutable { fn(); });
}
}  // namespace mgpu
