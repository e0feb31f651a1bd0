// cpp/core/tensor.h -- a contiguous, row-major view of a Storage: shape, dtype, byte offset.
// Tensors are cheap handles (copying one shares the storage). Views (reshape, row slices) share
// memory with their base; everything else allocates. Work on a tensor's data happens on its
// device's queue (see queue.h); the accessors here hand out raw pointers for those tasks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/shape.h"
#include "core/storage.h"

namespace mgpu {

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory of the given shape on the device (nothing is enqueued). A shape whose
  // bytes overflow is a ValueError and memory the device cannot give an OutOfMemoryError, both
  // naming `op` (the op allocating its output) and the shape.
  static Tensor empty(const Shape& shape, DType dtype, Device device, const char* op = "empty");
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
  // True when the two tensors' bytes overlap in the same storage.
  bool shares_memory(const Tensor& other) const;

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

// Enqueues fn on the device's queue, keeping `keep` (tensors, or vectors of tensors) alive until it
// has run. Tensors in `keep` whose storage is fresh (never touched by a task) are the task's
// outputs: their bytes count against the queue's byte budget while the task waits, and if the
// task fails -- or one of its inputs carries a kept failure -- they keep the error (sticky
// failures, see Storage::fail) and the task fails with it. The task runs all the same: a
// collective's part must reach its barrier, or the other devices would wait for ever.
template <typename Fn, typename... Keep>
void enqueue_on(Device device, const char* name, Fn&& fn, const Keep&... keep);

}  // namespace mgpu

#include "core/queue.h"

namespace mgpu {
namespace detail {

template <typename F>
void visit_tensors(const Tensor& t, F& f) { f(t); }
template <typename F>
void visit_tensors(const std::vector<Tensor>& ts, F& f) {
  for (const Tensor& t : ts) f(t);
}
template <typename T, typename F>
void visit_tensors(const T&, F&) {}

struct TaskOutputs {
  uint64_t mask = 0;  // bit i: the i-th tensor visited is an output (the first 64 are tracked)
  size_t bytes = 0;   // the outputs' bytes
};

// Host side, before enqueueing: notes that every kept tensor is queued and claims the fresh
// outputs.
template <typename... Keep>
TaskOutputs claim_outputs(const Keep&... keep) {
  TaskOutputs out;
  int i = 0;
  auto visit = [&](const Tensor& t) {
    const uint64_t bit = i < 64 ? uint64_t{1} << i : 0;
    ++i;
    if (t.defined()) t.storage()->note_queued();
    if (bit && t.defined() && t.storage()->claim_fresh()) {
      out.mask |= bit;
      out.bytes += t.storage()->nbytes();
    }
  };
  (visit_tensors(keep, visit), ...);
  (void)visit;  // unused when nothing is kept
  return out;
}

// Worker side: the first kept failure among the inputs, or null.
template <typename... Keep>
std::exception_ptr failed_input(uint64_t outputs, const Keep&... keep) {
  std::exception_ptr failed;
  int i = 0;
  auto visit = [&](const Tensor& t) {
    const uint64_t bit = i < 64 ? uint64_t{1} << i : 0;
    ++i;
    if (!failed && t.defined() && !(outputs & bit)) failed = t.storage()->error();
  };
  (visit_tensors(keep, visit), ...);
  (void)visit;  // unused when nothing is kept
  return failed;
}

template <typename... Keep>
void fail_outputs(uint64_t outputs, std::exception_ptr error, const Keep&... keep) {
  int i = 0;
  auto visit = [&](const Tensor& t) {
    const uint64_t bit = i < 64 ? uint64_t{1} << i : 0;
    ++i;
    if ((outputs & bit) && t.defined()) t.storage()->fail(error);
  };
  (visit_tensors(keep, visit), ...);
  (void)visit;  // unused when nothing is kept
}

}  // namespace detail

template <typename Fn, typename... Keep>
void enqueue_on(Device device, const char* name, Fn&& fn, const Keep&... keep) {
  const detail::TaskOutputs outs = detail::claim_outputs(keep...);
  queue_of(device).enqueue(name, [fn = std::forward<Fn>(fn), outputs = outs.mask, name, device,
                                  keep...]() mutable {
    std::exception_ptr failed = detail::failed_input(outputs, keep...);
    try {
      fn();
    } catch (...) {
      if (outputs)
        detail::fail_outputs(outputs, wrap_failure(name, device, std::current_exception()),
                             keep...);
      throw;
    }
    if (failed) {
      detail::fail_outputs(outputs, failed, keep...);
      std::rethrow_exception(failed);
    }
  }, outs.bytes);
}

}  // namespace mgpu
