// cpp/ops/conv2d.h -- 2-D convolution (cross-correlation, as in the chapter's F.conv2d) with
// stride and zero padding. Shapes: x (N, C, H, W), w (K, C, R, S), b (K,), y (N, K, P, Q) with
// P = (H + 2*pad - R) / stride + 1, Q likewise. Forward keeps nothing; backward re-reads x and w
// and writes dx, dw, db (never adds into them).
#pragma once

#include "core/tensor.h"

namespace mgpu::ops {

struct Conv2dGrads {
  Tensor dx, dw, db;  // db undefined when the conv has no bias; dx when not asked for
};

Tensor conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, int64_t stride,
                      int64_t pad);
Conv2dGrads conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, int64_t stride,
                            int64_t pad, bool need_dx, bool has_bias);

}  // namespace mgpu::ops
