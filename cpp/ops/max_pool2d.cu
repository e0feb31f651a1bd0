// cpp/ops/max_pool2d.cu -- max pooling as CUDA kernels (torchvision's ResNet stem: 3x3, stride 2,
// padding 1). x, dx (N, C, H, W); y, dy, indices (N, C, P, Q). Forward: one thread per output,
// reading its window in row-major order with cpu::'s winning rule. Backward: one thread per dx
// element, gathering the dy of the windows that cover it and chose it, in row-major window order:
// the additions of cpu::'s scatter in its order, without atomics. Executed on emulated GPUs against
// cpu::max_pool2d_*; compiled by nvcc for real GPUs.
#include <cmath>

#include "ops/launch.cuh"
#include "ops/max_pool2d.h"

namespace mgpu::ops::cuda {

namespace {

struct PoolDims {
  int H, W, kh, kw, sh, sw, ph, pw, P, Q;
};

__global__ void max_pool2d_forward_kernel(int total, PoolDims d, const float* __restrict__ x,
                                          float* __restrict__ y, int* __restrict__ indices) {
  for (int64_t idx = detail::grid_index(); idx < total; idx += detail::grid_stride()) {
    const int i = static_cast<int>(idx);  // < total, an int
    const int plane = i / (d.P * d.Q), p = i / d.Q % d.P, q = i % d.Q;
    const int top = p * d.sh - d.ph, left = q * d.sw - d.pw;
    const int r0 = max(top, 0), r1 = min(top + d.kh, d.H);
    const int c0 = max(left, 0), c1 = min(left + d.kw, d.W);
    const float* xp = x + static_cast<int64_t>(plane) * d.H * d.W;
    // PyTorch's scan: the first element in the image starts as the index, -inf as the value.
    float best = -INFINITY;
    int at = r0 * d.W + c0;
    for (int r = r0; r < r1; ++r) {
      for (int c = c0; c < c1; ++c) {
        const float v = xp[r * d.W + c];
        if (v > best || v != v) {
          best = v;
          at = r * d.W + c;
        }
      }
    }
    y[i] = best;
    if (indices) indices[i] = at;
  }
}

// dx[h, w] = the sum of dy[p, q] over the windows covering (h, w) whose index is h * W + w: the
// p with p*sh - ph <= h < p*sh - ph + kh and 0 <= p < P (likewise q), in p then q order.
__global__ void max_pool2d_backward_kernel(int total, PoolDims d, const int* __restrict__ indices,
                                           const float* __restrict__ dy,
                                           float* __restrict__ dx) {
  for (int64_t idx = detail::grid_index(); idx < total; idx += detail::grid_stride()) {
    const int i = static_cast<int>(idx);  // < total, an int
    const int plane = i / (d.H * d.W), h = i / d.W % d.H, w = i % d.W;
    const int me = h * d.W + w;
    const int hp = h + d.ph, wp = w + d.pw;  // in padded coordinates, >= 0
    const int p_lo = hp - d.kh + 1 > 0 ? (hp - d.kh + d.sh) / d.sh : 0;
    const int p_hi = min(hp / d.sh + 1, d.P);
    const int q_lo = wp - d.kw + 1 > 0 ? (wp - d.kw + d.sw) / d.sw : 0;
    const int q_hi = min(wp / d.sw + 1, d.Q);
    const int64_t base = static_cast<int64_t>(plane) * d.P * d.Q;
    float sum = 0.0f;
    for (int p = p_lo; p < p_hi; ++p) {
      for (int q = q_lo; q < q_hi; ++q) {
        const int64_t o = base + p * d.Q + q;
        if (indices[o] == me) sum += dy[o];
      }
    }
    dx[i] = sum;
  }
}

constexpr int kThreads = 256;

PoolDims pool_dims(const char* op, const MaxPoolShape& s) {
  using detail::as_int;
  detail::require(s.kh >= 1 && s.kw >= 1 && s.sh >= 1 && s.sw >= 1 && s.ph >= 0 && s.pw >= 0 &&
                      2 * s.ph <= s.kh && 2 * s.pw <= s.kw && s.H + 2 * s.ph >= s.kh &&
                      s.W + 2 * s.pw >= s.kw,
                  op, "needs kernel, stride >= 1, 0 <= padding <= kernel / 2, a window that fits");
  as_int(op, "N*C*H*W", s.N * s.C * s.H * s.W);
  as_int(op, "N*C*P*Q", s.N * s.C * s.P() * s.Q());
  return PoolDims{as_int(op, "H", s.H),   as_int(op, "W", s.W),   as_int(op, "kh", s.kh),
                  as_int(op, "kw", s.kw), as_int(op, "sh", s.sh), as_int(op, "sw", s.sw),
                  as_int(op, "ph", s.ph), as_int(op, "pw", s.pw), as_int(op, "P", s.P()),
                  as_int(op, "Q", s.Q())};
}

int grid_for(int total) {
  const int wanted = detail::ceil_div(total, kThreads);
  return wanted < 4096 ? wanted : 4096;
}

}  // namespace

void max_pool2d_forward(const MaxPoolShape& s, const float* x, float* y, int32_t* indices,
                        cudaStream_t stream) {
  const PoolDims d = pool_dims("cuda::max_pool2d_forward", s);
  const int total = static_cast<int>(s.N * s.C) * d.P * d.Q;
  if (total == 0) return;
  MGPU_LAUNCH(max_pool2d_forward_kernel, grid_for(total), kThreads, 0, stream)(total, d, x, y,
                                                                               indices);
  MGPU_CUDA_CHECK_LAUNCH();
}

void max_pool2d_backward(const MaxPoolShape& s, const int32_t* indices, const float* dy,
                         float* dx, cudaStream_t stream) {
  const PoolDims d = pool_dims("cuda::max_pool2d_backward", s);
  const int total = static_cast<int>(s.N * s.C * s.H * s.W);
  if (total == 0) return;
  MGPU_LAUNCH(max_pool2d_backward_kernel, grid_for(total), kThreads, 0, stream)(total, d, indices,
                                                                                dy, dx);
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace mgpu::ops::cuda
