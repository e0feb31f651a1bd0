// cpp/ops/relu.h -- y = max(x, 0). x, y, dy, dx share one contiguous shape, seen as (n,).
// Backward writes dx (it never adds into it) and re-reads x, so forward caches nothing.
// Kernels: the two bodies below, run by for_each_index (relu.cu instantiates them for CUDA).
// NaN propagates as IEEE and PyTorch have it: relu(NaN) = NaN, and its gradient passes dy
// (written !(x <= 0), true for NaN, where x > 0 would silently turn NaN into 0).
#pragma once

#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mgpu::ops {

struct ReluOut {
  const float* x; float* y;
  MGPU_HD void operator()(int64_t i) const { y[i] = !(x[i] <= 0.0f) ? x[i] : 0.0f; }
};
struct ReluGradInput {
  const float* x; const float* dy; float* dx;
  // dy[i] is loaded whatever the sign: a load inside the condition cannot be vectorised (the
  // compiler may not invent it) and branches on random signs -- 20x slower on the CPU.
  MGPU_HD void operator()(int64_t i) const {
    float g = dy[i];
    dx[i] = !(x[i] <= 0.0f) ? g : 0.0f;
  }
};

Tensor relu_forward(const Tensor& x);
Tensor relu_backward(const Tensor& x, const Tensor& dy);  // returns dx

}  // namespace mgpu::ops
