// cpp/ops/avg_pool2d.h -- average pooling without padding, floor output size.
// x (N, C, H, W), y (N, C, P, Q) with P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1: a 9x9 map
// pooled 2x2 with stride 2 gives 4x4 (the last row and column are dropped, as in the chapter's
// LeNet). Backward spreads dy evenly over each window and writes dx (zeros outside windows).
#pragma once

#include "core/tensor.h"

namespace mgpu::ops {

Tensor avg_pool2d_forward(const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw);
Tensor avg_pool2d_backward(const Tensor& x, const Tensor& dy, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw);  // returns dx, shaped like x

}  // namespace mgpu::ops
