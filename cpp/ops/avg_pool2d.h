// cpp/ops/avg_pool2d.h -- average pooling without padding, floor output size.
// x (N, C, H, W), y (N, C, P, Q) with P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1: a 9x9 map
// pooled 2x2 with stride 2 gives 4x4 (the last row and column are dropped, as in the chapter's
// LeNet). Backward spreads dy evenly over each window and writes dx (zeros outside windows).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"

namespace mgpu::ops {

Tensor avg_pool2d_forward(const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw);
Tensor avg_pool2d_backward(const Tensor& x, const Tensor& dy, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw);  // returns dx, shaped like x

// The kernels (float32, contiguous, raw pointers; the caller checks shapes and allocates).
// Preconditions: 1 <= kh <= H, 1 <= kw <= W, sh, sw >= 1.
namespace cpu {
void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y);
// Given dy (N, C, P, Q), writes dx (N, C, H, W): each dx element gathers dy / (kh * kw) from every
// window that covers it (overlapping windows when stride < kernel), zero where none does.
void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx);
}  // namespace cpu

namespace cuda {
// As cpu::, enqueued on `stream`. One thread per output element, adding in cpu::'s order;
// backward is the gather form (each dx element sums dy over the windows that cover it; no atomics).
void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y, cudaStream_t stream);
void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx, cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
