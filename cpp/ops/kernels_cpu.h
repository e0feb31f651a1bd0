// cpp/ops/kernels_cpu.h -- the raw CPU kernels behind LeNet's ops (chapter 12.5): float32, NCHW
// contiguous, raw pointers, no Tensor; callers (ops/*.cpp) check shapes and allocate. A kernel
// writes its outputs (overwrites, never adds into them; outputs never overlap inputs) and gives
// bitwise-identical results whatever the thread count. Shape letters: N batch, C in-channels,
// K out-channels, H/W image, R/S kernel, P/Q output height/width; matrices are (n rows, m columns).
#pragma once

#include <cstdint>

namespace mgpu::ops::cpu {

// ---- conv2d: x (N, C, H, W), w (K, C, R, S), b (K), y (N, K, P, Q) ----
// Cross-correlation (PyTorch's F.conv2d), the same stride and zero padding on both axes.
// Preconditions: stride >= 1, pad >= 0, P() >= 1, Q() >= 1.
struct Conv2dShape {
  int64_t N, C, H, W, K, R, S, stride, pad;
  int64_t P() const { return (H + 2 * pad - R) / stride + 1; }
  int64_t Q() const { return (W + 2 * pad - S) / stride + 1; }
};

// Writes y = conv(x, w) + b; b may be null (no bias). Forward keeps nothing for backward.
void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b, float* y);

// Given dy (N, K, P, Q), writes dx (N, C, H, W), dw (K, C, R, S) and db (K); dx and db may be null
// to skip them (LeNet's first layer needs no dx), dw may not. Re-reads x and w. dw and db sum over
// the batch in fixed blocks of images (8 or 16, by shape), then over the blocks in order
// (conv2d_cpu.cpp), so the order of additions depends on the shape but never on the thread count.
void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db);

// ---- conv2d + bias + relu + avg_pool2d, fused (LeNet's two conv blocks) ----
// With y = conv(x, w) + b (N, K, P, Q): pooled (N, K, P / pool, Q / pool) = avg_pool2d(relu(y),
// pool x pool windows, stride pool) and mask (N, K, P, Q) = (y > 0), relu's derivative, kept
// for backward instead of y (a quarter of the memory traffic). Computed block by block while the
// conv's product is in cache; pooled has the bits of conv2d_forward, then relu, then
// avg_pool2d_forward. mask and b may be null. Preconditions: 1 <= pool <= min(P, Q).
void conv2d_relu_pool_forward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                              const float* b, uint8_t* mask, float* pooled);
// Given dpooled, writes dx, dw and db as conv2d_backward does for
// dy = relu_backward(y, avg_pool2d_backward(dpooled)), bit for bit, without materialising dy.
// dx and db may be null.
void conv2d_relu_pool_backward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                               const uint8_t* mask, const float* dpooled, float* dx, float* dw,
                               float* db);

// ---- avg_pool2d: x, dx (N, C, H, W); y, dy (N, C, P, Q) ----
// P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1: no padding, and rows and columns that no window
// reaches are dropped (9x9, 2x2 stride 2 -> 4x4). Preconditions: 1 <= kh <= H, 1 <= kw <= W,
// sh, sw >= 1.
void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y);
// Given dy (N, C, P, Q), writes dx (N, C, H, W): each dx element gathers dy / (kh * kw) from every
// window that covers it (overlapping windows when stride < kernel), zero where none does.
void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx);

// ---- linear's bias gradient: dy (n, m), db (m) ----
// (relu, the bias add and the SGD step are per-element bodies in relu.h / elementwise.h.)
// Writes db[j] = sum_i dy[i, j], added in i order (the documented order of the batch sum).
void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db);

// ---- softmax cross-entropy: logits, dlogits (n, m), labels, loss, dloss (n) ----
// Writes loss[i] = logsumexp(z_i) - z_i[label_i] (reduction none), computed from z - max(z) so
// logits in the thousands neither overflow nor lose the small terms. Backward writes
// dlogits = (softmax(z) - onehot(label)) * dloss[i]. Labels are checked before anything is
// written (the data lives on the device, so this is the first place that sees them): a label
// outside [0, m) throws std::out_of_range naming the label, its row and m.
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss);
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits);

// ---- argmax: x (n, m), out (n) ----
// Writes the column of each row's maximum; the first one wins ties, and like NumPy a NaN counts
// as the maximum (the first NaN wins). Preconditions: m >= 1.
void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out);

}  // namespace mgpu::ops::cpu
