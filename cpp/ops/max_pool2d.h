// cpp/ops/max_pool2d.h -- max pooling with implicit -inf padding and floor output size (PyTorch's
// F.max_pool2d with dilation 1, ceil_mode False). x, dx (N, C, H, W); y, dy, indices (N, C, P, Q)
// with P = (H + 2 ph - kh) / sh + 1, Q = (W + 2 pw - kw) / sw + 1. Forward keeps, per output, where
// its maximum sits as h * W + w in its input plane (int32). The rule is PyTorch's CPU kernel's: the
// window is read in row-major order and an element wins if it is greater than the best so far or
// NaN, so ties go to the first maximum and a NaN to the last NaN. Backward adds each dy to dx at
// its index and writes dx (zeros where no window's maximum sits).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"

namespace mgpu::ops {

// The geometry of one max pooling: 1 <= kh, kw; 1 <= sh, sw; 0 <= ph <= kh / 2, 0 <= pw <= kw / 2
// (so every window holds at least one input element), H * W < 2^31.
struct MaxPoolShape {
  int64_t N, C, H, W, kh, kw, sh, sw, ph, pw;
  int64_t P() const { return (H + 2 * ph - kh) / sh + 1; }
  int64_t Q() const { return (W + 2 * pw - kw) / sw + 1; }
};

struct MaxPool2d {
  Tensor y, indices;  // indices: int32, undefined when forward was asked not to keep them
};

MaxPool2d max_pool2d_forward(const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                             int64_t ph, int64_t pw, bool keep_indices = true);
// dx (N, C, H, W) from forward's indices and dy, both (N, C, P, Q).
Tensor max_pool2d_backward(const Tensor& indices, const Tensor& dy, int64_t H, int64_t W,
                           int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw);

// The kernels (contiguous, raw pointers; the caller checks shapes and allocates).
namespace cpu {
// Writes y and, unless it is null, indices.
void max_pool2d_forward(const MaxPoolShape& s, const float* x, float* y, int32_t* indices);
// Writes dx: zeros, then dy[o] added at indices[o] for every output o of a plane in row-major
// order. Indices are forward's (an index outside the plane is skipped, never written through).
void max_pool2d_backward(const MaxPoolShape& s, const int32_t* indices, const float* dy,
                         float* dx);
}  // namespace cpu

namespace cuda {
// As cpu::, enqueued on `stream`, the same bits. Forward: one thread per output. Backward: one
// thread per dx element, gathering dy over the windows that cover it whose index names it, in
// row-major window order (cpu::'s order of additions; no atomics).
void max_pool2d_forward(const MaxPoolShape& s, const float* x, float* y, int32_t* indices,
                        cudaStream_t stream);
void max_pool2d_backward(const MaxPoolShape& s, const int32_t* indices, const float* dy,
                         float* dx, cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
