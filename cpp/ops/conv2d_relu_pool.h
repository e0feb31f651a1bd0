// cpp/ops/conv2d_relu_pool.h -- conv2d + bias, relu and avg_pool2d (pool x pool windows, stride
// pool) fused in one op: LeNet's two conv blocks on CPU devices. x, w, b as conv2d (conv2d.h);
// pooled (N, K, P / pool, Q / pool) has the bits of the three ops in a row, NaN included. Forward
// keeps relu's mask (uint8, !(y <= 0): set for NaN, as relu passes it) instead of y; backward
// writes dx, dw, db. Kernels: conv2d_cpu.cpp (no CUDA: GPUs run the three ops).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/conv2d.h"

namespace mgpu::ops {

struct Conv2dReluPool {
  Tensor pooled;  // (N, K, P / pool, Q / pool)
  Tensor mask;    // (N, K, P, Q) uint8; undefined unless forward was asked to keep it
};

// CPU devices only (a GPU raises ValueError: run conv2d, relu and avg_pool2d there).
// keep_mask = false (inference) skips what only backward needs.
Conv2dReluPool conv2d_relu_pool_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                        int64_t stride, int64_t pad, int64_t pool,
                                        bool keep_mask);
// Given dpooled, returns dx (when need_dx), dw and db as conv2d_backward would for
// dy = relu_backward(y, avg_pool2d_backward(dpooled)), bit for bit.
Conv2dGrads conv2d_relu_pool_backward(const Tensor& x, const Tensor& w, const Tensor& mask,
                                      const Tensor& dpooled, int64_t stride, int64_t pad,
                                      int64_t pool, bool need_dx);

namespace cpu {
// Computed block by block while the conv's product is in cache. mask and b may be null.
// Preconditions: conv2d's, and 1 <= pool <= min(P, Q).
void conv2d_relu_pool_forward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                              const float* b, uint8_t* mask, float* pooled);
// Writes dx, dw, db without materialising dy; dx and db may be null.
void conv2d_relu_pool_backward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                               const uint8_t* mask, const float* dpooled, float* dx, float* dw,
                               float* db);
}  // namespace cpu

}  // namespace mgpu::ops
