// cpp/ops/linear.h -- matrix products: y = op(a) @ op(b), op transposing when asked.
// a (M, K), b (K, N), y (M, N) (before transposition). The chapter's dense layers are
// mm(h, W) + b; their backward is da = dy @ b^T and db = a^T @ dy, the same op transposed.
#pragma once

#include "core/tensor.h"

namespace mgpu::ops {

Tensor mm(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

}  // namespace mgpu::ops
