// cpp/ops/avg_pool2d.cu -- average pooling as CUDA kernels (LeNet's two 2 x 2, stride-2 pools).
// x, dx (N, C, H, W); y, dy (N, C, P, Q) with P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1, no
// padding. One thread per output element, a grid-stride loop over all planes; both directions
// read each input once, so there is nothing for shared memory to save. Executed on emulated GPUs
// against cpu::avg_pool2d_*; compiled by nvcc for real GPUs.
#include "ops/launch.cuh"
#include "ops/avg_pool2d.h"

namespace mgpu::ops::cuda {

namespace {

struct PoolDims {
  int H, W, kh, kw, sh, sw, P, Q;
};

__global__ void avg_pool2d_forward_kernel(int total, PoolDims d, const float* __restrict__ x,
                                          float* __restrict__ y) {
  const float area = static_cast<float>(d.kh * d.kw);
  for (int64_t idx = detail::grid_index(); idx < total; idx += detail::grid_stride()) {
    const int i = static_cast<int>(idx);  // < total, an int
    const int plane = i / (d.P * d.Q), p = i / d.Q % d.P, q = i % d.Q;
    const float* at = x + (plane * d.H + p * d.sh) * d.W + q * d.sw;
    // The window's rows first, then its columns: the order of cpu::avg_pool2d_forward.
    float sum = 0.0f;
    for (int s = 0; s < d.kw; ++s) {
      float column = at[s];
      for (int r = 1; r < d.kh; ++r) column += at[r * d.W + s];
      sum = s == 0 ? column : sum + column;
    }
    y[i] = sum / area;
  }
}

// dx[h, w] = sum of dy[p, q] / (kh * kw) over the windows covering (h, w): the p with
// p*sh <= h < p*sh + kh and p < P, i.e. p in [ceil((h - kh + 1) / sh), h / sh] (likewise q).
__global__ void avg_pool2d_backward_kernel(int total, PoolDims d, const float* __restrict__ dy,
                                           float* __restrict__ dx) {
  const float area = static_cast<float>(d.kh * d.kw);
  for (int64_t idx = detail::grid_index(); idx < total; idx += detail::grid_stride()) {
    const int i = static_cast<int>(idx);  // < total, an int
    const int plane = i / (d.H * d.W), h = i / d.W % d.H, w = i % d.W;
    const int p_lo = h - d.kh + 1 > 0 ? (h - d.kh + d.sh) / d.sh : 0;
    const int p_hi = min(h / d.sh + 1, d.P);
    const int q_lo = w - d.kw + 1 > 0 ? (w - d.kw + d.sw) / d.sw : 0;
    const int q_hi = min(w / d.sw + 1, d.Q);
    const float* dyp = dy + plane * d.P * d.Q;
    // Rows summed per column in p order, then the columns in q order: cpu::'s order.
    float sum = 0.0f;
    for (int q = q_lo; q < q_hi && p_lo < p_hi; ++q) {
      float column = dyp[p_lo * d.Q + q];
      for (int p = p_lo + 1; p < p_hi; ++p) column += dyp[p * d.Q + q];
      sum = q == q_lo ? column : sum + column;
    }
    dx[i] = sum / area;  // 0 where no window covers (h, w)
  }
}

constexpr int kThreads = 256;

PoolDims pool_dims(const char* op, int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh,
                   int64_t kw, int64_t sh, int64_t sw) {
  using detail::as_int;
  detail::require(kh >= 1 && kh <= H && kw >= 1 && kw <= W && sh >= 1 && sw >= 1, op,
                  "needs 1 <= kh <= H, 1 <= kw <= W and strides >= 1");
  as_int(op, "N*C*H*W", N * C * H * W);
  return PoolDims{as_int(op, "H", H),
                  as_int(op, "W", W),
                  as_int(op, "kh", kh),
                  as_int(op, "kw", kw),
                  as_int(op, "sh", sh),
                  as_int(op, "sw", sw),
                  as_int(op, "P", (H - kh) / sh + 1),
                  as_int(op, "Q", (W - kw) / sw + 1)};
}

unsigned grid_for(const char* op, int total) {
  const unsigned wanted = detail::grid_blocks(op, total, kThreads);
  return wanted < 4096 ? wanted : 4096;
}

}  // namespace

void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y, cudaStream_t stream) {
  const PoolDims d = pool_dims("cuda::avg_pool2d_forward", N, C, H, W, kh, kw, sh, sw);
  const int total = static_cast<int>(N * C) * d.P * d.Q;
  if (total == 0) return;
  MGPU_LAUNCH(avg_pool2d_forward_kernel, grid_for("cuda::avg_pool2d_forward", total), kThreads, 0,
              stream)(total, d, x, y);
  MGPU_CUDA_CHECK_LAUNCH();
}

void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx, cudaStream_t stream) {
  const PoolDims d = pool_dims("cuda::avg_pool2d_backward", N, C, H, W, kh, kw, sh, sw);
  const int total = static_cast<int>(N * C * H * W);
  if (total == 0) return;
  MGPU_LAUNCH(avg_pool2d_backward_kernel, grid_for("cuda::avg_pool2d_backward", total), kThreads,
              0, stream)(total, d, dy, dx);
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace mgpu::ops::cuda
