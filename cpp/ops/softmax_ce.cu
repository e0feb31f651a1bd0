// cpp/ops/softmax_ce.cu -- softmax cross-entropy as CUDA kernels, one warp per row. logits,
// dlogits (n, m); labels (n) int64 or int32; loss, dloss (n). loss_i = z_top - z_label +
// log1p(sum_{j != top} exp(z_j - z_top)), z_top the row's first maximum (cpu::'s formula); backward
// dlogits_i = (softmax(z_i) - onehot(y_i)) * dloss_i. Also the fused step's label guard
// (find_bad_label, restore_if_flagged). Executed on emulated GPUs against cpu::;
// compiled by nvcc for real GPUs.
#include <cmath>

#include "ops/launch.cuh"
#include "ops/softmax_ce.h"

namespace mgpu::ops::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;

struct RowStats {
  float top_value;  // the row's maximum, at its first column
  int top;
  float rest;  // sum over j != top of exp(z_j - z_top), each term in (0, 1]
};

// The warp's lanes take columns lane, lane + 32, ...; a butterfly of shuffles leaves every lane
// with the row's first maximum, then with the sum of the other terms (the same fixed tree on
// every run, so the loss is reproducible bit for bit).
__device__ RowStats row_stats(const float* __restrict__ z, int m, int lane) {
  float best = 0.0f;
  int top = -1;
  for (int64_t j = lane; j < m; j += kWarp) {  // 64 bits: j + kWarp passes 2^31 for m near it
    if (top < 0 || z[j] > best) {
      best = z[j];
      top = static_cast<int>(j);
    }
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, best, offset);
    const int other_top = __shfl_xor_sync(kFullMask, top, offset);
    if (other_top >= 0 && (top < 0 || other > best || (other == best && other_top < top))) {
      best = other;
      top = other_top;
    }
  }
  float rest = 0.0f;
  for (int64_t j = lane; j < m; j += kWarp) {
    if (j != top) rest += expf(z[j] - best);
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    rest += __shfl_xor_sync(kFullMask, rest, offset);
  }
  return RowStats{best, top, rest};
}

// A label outside [0, m) is never used as an index (it would read another row, or outside the
// logits); its row becomes NaN and bad_row (if given) is lowered to the smallest such row.
__device__ inline bool label_ok(int64_t label, int m, int row, int* bad_row, int lane) {
  if (label >= 0 && label < m) return true;
  if (lane == 0 && bad_row != nullptr) atomicMin(bad_row, row);
  return false;
}

template <class Label>
__global__ void softmax_ce_forward_kernel(int n, int m, const float* __restrict__ logits,
                                          const Label* __restrict__ labels,
                                          float* __restrict__ loss, int* bad_row) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row64 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row64 >= n) return;
  const int row = static_cast<int>(row64);  // < n, an int  // the whole warp leaves together: the shuffles see full warps
  const float* z = logits + row * m;
  const RowStats st = row_stats(z, m, lane);
  const int64_t label = static_cast<int64_t>(labels[row]);
  const bool ok = label_ok(label, m, row, bad_row, lane);
  if (lane == 0) loss[row] = ok ? (st.top_value - z[label]) + log1pf(st.rest) : NAN;
}

template <class Label>
__global__ void softmax_ce_backward_kernel(int n, int m, const float* __restrict__ logits,
                                           const Label* __restrict__ labels,
                                           const float* __restrict__ dloss,
                                           float* __restrict__ dlogits, int* bad_row) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row64 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row64 >= n) return;
  const int row = static_cast<int>(row64);  // < n, an int
  const float* z = logits + row * m;
  float* dz = dlogits + row * m;
  const RowStats st = row_stats(z, m, lane);
  const int64_t label = static_cast<int64_t>(labels[row]);
  const bool ok = label_ok(label, m, row, bad_row, lane);
  const float inv_sum = 1.0f / (1.0f + st.rest);
  const float g = dloss[row];
  for (int64_t j = lane; j < m; j += kWarp) {
    const float p = expf(z[j] - st.top_value) * inv_sum;
    dz[j] = ok ? (p - (j == label ? 1.0f : 0.0f)) * g : NAN;
  }
}

template <class Label>
void forward(int64_t n, int64_t m, const float* logits, const Label* labels, float* loss,
             int32_t* bad_row, cudaStream_t stream) {
  const char* op = "cuda::softmax_ce_forward";
  if (bad_row != nullptr) MGPU_CUDA_CHECK(cudaMemsetAsync(bad_row, 0x7f, sizeof(int32_t), stream));
  if (n <= 0) return;
  detail::require(m >= 1, op, "needs m >= 1 classes");
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  auto* kernel = softmax_ce_forward_kernel<Label>;
  MGPU_LAUNCH(kernel, detail::grid_blocks(op, ni, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream)
  (ni, mi, logits, labels, loss, bad_row);
  MGPU_CUDA_CHECK_LAUNCH();
}

template <class Label>
void backward(int64_t n, int64_t m, const float* logits, const Label* labels, const float* dloss,
              float* dlogits, int32_t* bad_row, cudaStream_t stream) {
  const char* op = "cuda::softmax_ce_backward";
  if (bad_row != nullptr) MGPU_CUDA_CHECK(cudaMemsetAsync(bad_row, 0x7f, sizeof(int32_t), stream));
  if (n <= 0) return;
  detail::require(m >= 1, op, "needs m >= 1 classes");
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  auto* kernel = softmax_ce_backward_kernel<Label>;
  MGPU_LAUNCH(kernel, detail::grid_blocks(op, ni, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream)
  (ni, mi, logits, labels, dloss, dlogits, bad_row);
  MGPU_CUDA_CHECK_LAUNCH();
}

template <class Label>
__global__ void find_bad_label_kernel(int n, int64_t m, const Label* __restrict__ labels,
                                      int32_t* bad_row) {
  for (int64_t idx = detail::grid_index(); idx < n; idx += detail::grid_stride()) {
    const int i = static_cast<int>(idx);  // < n, an int
    const int64_t label = labels[i];
    if (label < 0 || label >= m) atomicMin(bad_row, i);
  }
}

template <class Label>
void find_bad(int64_t n, int64_t m, const Label* labels, int32_t* bad_row, cudaStream_t stream) {
  const char* op = "cuda::find_bad_label";
  MGPU_CUDA_CHECK(cudaMemsetAsync(bad_row, 0x7f, sizeof(int32_t), stream));
  if (n <= 0) return;
  const int ni = detail::as_int(op, "n", n);
  constexpr int kThreads = 256;
  auto* kernel = find_bad_label_kernel<Label>;
  MGPU_LAUNCH(kernel, detail::ceil_div(ni, kThreads) < 64 ? detail::ceil_div(ni, kThreads) : 64,
              kThreads, 0, stream)
  (ni, m, labels, bad_row);
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace

template void for_each_index<RestoreIfFlagged>(int64_t, const RestoreIfFlagged&, cudaStream_t);

void find_bad_label(int64_t n, int64_t m, const int64_t* labels, int32_t* bad_row,
                    cudaStream_t stream) {
  find_bad(n, m, labels, bad_row, stream);
}
void find_bad_label(int64_t n, int64_t m, const int32_t* labels, int32_t* bad_row,
                    cudaStream_t stream) {
  find_bad(n, m, labels, bad_row, stream);
}

void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream) {
  forward(n, m, logits, labels, loss, bad_row, stream);
}
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream) {
  forward(n, m, logits, labels, loss, bad_row, stream);
}
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row,
                         cudaStream_t stream) {
  backward(n, m, logits, labels, dloss, dlogits, bad_row, stream);
}
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row,
                         cudaStream_t stream) {
  backward(n, m, logits, labels, dloss, dlogits, bad_row, stream);
}

}  // namespace mgpu::ops::cuda
