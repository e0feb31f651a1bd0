// cpp/core/tensor.cpp -- tensor construction, views and the shared argument checks.
#include "core/tensor.h"

#include <algorithm>
#include <sstream>

namespace mgpu {

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    MGPU_CHECK_VALUE(d >= 0, "negative dimension in shape ", shape);
  check_device(device);
  size_t nbytes = static_cast<size_t>(mgpu::numel(shape)) * dtype_size(dtype);
  return Tensor(Storage::allocate(device, nbytes), shape, dtype, 0);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, int64_t offset)
    : storage_(std::move(storage)), shape_(std::move(shape)), dtype_(dtype), offset_(offset) {
  MGPU_ASSERT(storage_ != nullptr);
  MGPU_ASSERT(offset_ >= 0 && static_cast<size_t>(offset_) + nbytes() <= storage_->nbytes(),
              "view exceeds its storage");
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MGPU_CHECK_VALUE(infer < 0, "reshape: only one dimension may be -1, got ", shape);
      infer = static_cast<int64_t>(i);
    } else {
      MGPU_CHECK_VALUE(shape[i] >= 0, "reshape: invalid dimension ", shape[i], " in ", shape);
      known *= shape[i];
    }
  }
  if (infer >= 0 && known == 0 && infer + 1 == static_cast<int64_t>(shape.size()) &&
      infer <= dim() && std::equal(shape.begin(), shape.begin() + infer, shape_.begin())) {
    // An empty batch flattened as x.reshape(x.shape[0], -1): -1 is ambiguous by element count,
    // but the leading extents are kept, so -1 stands for the product of the rest (a data-parallel
    // shard can be empty when a batch has fewer examples than there are devices).
    shape[infer] = 1;
    for (int64_t i = infer; i < dim(); ++i) shape[infer] *= shape_[i];
  } else if (infer >= 0) {
    MGPU_CHECK_VALUE(known > 0 && numel() % known == 0, "reshape: cannot view shape ", shape_,
                     " (", numel(), " elements) as ", shape);
    shape[infer] = numel() / known;
  }
  MGPU_CHECK_VALUE(mgpu::numel(shape) == numel(), "reshape: cannot view shape ", shape_, " (",
                   numel(), " elements) as ", shape, " (", mgpu::numel(shape), " elements)");
  return Tensor(storage_, std::move(shape), dtype_, offset_);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  MGPU_CHECK_VALUE(dim() >= 1, "cannot slice rows of a 0-d tensor");
  MGPU_CHECK_INDEX(0 <= begin && begin <= end && end <= shape_[0], "rows [", begin, ", ", end,
                   ") out of range for axis 0 of size ", shape_[0]);
  Shape s = shape_;
  s[0] = end - begin;
  int64_t row_bytes = shape_[0] ? static_cast<int64_t>(nbytes()) / shape_[0] : 0;
  return Tensor(storage_, std::move(s), dtype_, offset_ + begin * row_bytes);
}

std::string describe(const Tensor& t) {
  std::ostringstream out;
  out << dtype_name(t.dtype()) << " tensor of shape " << t.shape() << " on " << t.device();
  return out.str();
}

void require_same_device(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t || !t->defined()) continue;
    if (!first) {
      first = t;
      continue;
    }
    MGPU_CHECK_VALUE(t->device() == first->device(), op, ": all tensors must be on one device, got ",
                     first->device(), " and ", t->device(),
                     "; move one with .to(device) (or copyto) first");
  }
}

void require_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  MGPU_CHECK_TYPE(t.dtype() == want, op, ": ", name, " must be ", dtype_name(want), ", got ",
                  dtype_name(t.dtype()));
}

}  // namespace mgpu
