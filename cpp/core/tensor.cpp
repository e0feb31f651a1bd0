// cpp/core/tensor.cpp -- tensor construction, views and the shared argument checks.
#include "core/tensor.h"

#include <algorithm>
#include <sstream>

namespace mgpu {

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, const char* op) {
  const int64_t nbytes = checked_nbytes(shape, static_cast<int64_t>(dtype_size(dtype)), op);
  check_device(device);
  try {
    return Tensor(Storage::allocate(device, static_cast<size_t>(nbytes)), shape, dtype, 0);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(detail::cat(op, ": cannot allocate a ", dtype_name(dtype),
                                       " tensor of shape ", shape, ": ", e.what()));
  }
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, int64_t offset)
    : storage_(std::move(storage)), shape_(std::move(shape)), dtype_(dtype), offset_(offset) {
  MGPU_ASSERT(storage_ != nullptr);
  const int64_t bytes = checked_nbytes(shape_, static_cast<int64_t>(dtype_size(dtype_)), "tensor");
  MGPU_ASSERT(offset_ >= 0 && static_cast<size_t>(bytes) <= storage_->nbytes() &&
                  static_cast<size_t>(offset_) <= storage_->nbytes() - static_cast<size_t>(bytes),
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
      // A product past int64 cannot equal this tensor's element count: report it as such.
      if (__builtin_mul_overflow(known, shape[i], &known)) known = -1;
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
  MGPU_CHECK_VALUE(known >= 0, "reshape: cannot view shape ", shape_, " (", numel(),
                   " elements) as ", shape, ": its element count overflows int64");
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

bool Tensor::shares_memory(const Tensor& o) const {
  if (storage_ != o.storage_) return false;
  int64_t a0 = offset_, a1 = offset_ + static_cast<int64_t>(nbytes());
  int64_t b0 = o.offset_, b1 = o.offset_ + static_cast<int64_t>(o.nbytes());
  return a0 < b1 && b0 < a1;
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
  // A bfloat16 tensor holds data (interop, checkpoints); ops compute on float32 tensors, in
  // bfloat16 under autocast.
  const char* fix = t.dtype() == DType::BF16 && want == DType::F32
                        ? "; convert it with .astype(mgpu.float32), or keep float32 tensors and "
                          "compute in bfloat16 under mgpu.autocast('bf16')"
                        : "";
  MGPU_CHECK_TYPE(t.dtype() == want, op, ": ", name, " must be ", dtype_name(want), ", got ",
                  dtype_name(t.dtype()), fix);
}

}  // namespace mgpu
