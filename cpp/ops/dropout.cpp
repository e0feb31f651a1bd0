// cpp/ops/dropout.cpp -- validate, allocate, dispatch dropout's masked products (dropout.h).
#include "ops/dropout.h"

#include <cmath>

namespace mgpu::ops {
namespace {

Tensor masked(const char* op, const char* name, const Tensor& in, const DropoutKey& key) {
  require_dtype(op, name, in, DType::F32);
  MGPU_CHECK_VALUE(key.p >= 0.0 && key.p <= 1.0, op, ": p must be a probability in [0, 1], got ",
                   key.p);
  MGPU_CHECK_VALUE(in.dim() >= 1, op, ": ", name, " must have a batch axis (N, ...), got a 0-d "
                   "tensor");
  const int64_t rows = in.size(0);
  const int64_t row_len = rows == 0 ? 0 : in.numel() / rows;
  // The counter holds a row's index and its block index in 32 bits each.
  constexpr int64_t kWords = int64_t{1} << 32;
  MGPU_CHECK_VALUE(key.first_row >= 0 && key.first_row + rows <= kWords, op, ": rows ",
                   key.first_row, " to ", key.first_row + rows, " do not fit the mask's 32-bit "
                   "row counter; use batches of fewer than 2^32 examples");
  MGPU_CHECK_VALUE((row_len + 3) / 4 <= kWords, op, ": ", row_len, " elements per example do "
                   "not fit the mask's 32-bit block counter");
  Tensor out = Tensor::empty_like(in);
  if (in.numel() == 0) return out;
  const int64_t groups = (row_len + 3) / 4;
  // u >= p with u = r / 2^32 exactly: r >= ceil(p 2^32) (p 2^32 is exact in double).
  const auto threshold = static_cast<uint64_t>(std::ceil(key.p * 4294967296.0));
  const float scale = key.p >= 1.0 ? 0.0f : 1.0f / static_cast<float>(1.0 - key.p);
  for_each_index(op, in.device(), rows * groups,
                 DropoutMasked{in.f32(), out.f32(), row_len, groups, key.seed, threshold,
                               key.stream, key.first_row, scale},
                 in, out);
  return out;
}

}  // namespace

Tensor dropout_forward(const Tensor& x, const DropoutKey& key) {
  return masked("dropout_forward", "x", x, key);
}

Tensor dropout_backward(const Tensor& dy, const DropoutKey& key) {
  return masked("dropout_backward", "dy", dy, key);
}

}  // namespace mgpu::ops
