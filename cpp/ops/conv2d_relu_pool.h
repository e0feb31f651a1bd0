// cpp/ops/conv2d_relu_pool.h -- conv2d + bias, relu and avg_pool2d (pool x pool windows, stride
// pool) fused in one op: LeNet's two conv blocks on CPU devices. x, w, b as conv2d (conv2d.h);
// pooled (N, K, P / pool, Q / pool) has the bits of the three ops in a row, NaN included. Forward
// keeps relu's mask (uint8, !(y <= 0): set for NaN, as relu passes it) instead of y; backward
// writes dx, dw, db. Kernels: conv2d_cpu.cpp (no CUDA: GPUs run the three ops).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/conv2d.h"
#include "ops/precision.h"

namespace mgpu::ops {

struct Conv2dReluPool {
  Tensor pooled;  // (N, K, P / pool, Q / pool)
  Tensor mask;    // (N, K, P, Q) uint8; undefined unless forward was asked to keep it
};

// CPU devices only (a GPU raises ValueError: run conv2d, relu and avg_pool2d there).
// keep_mask = false (inference) skips what only backward needs.
// precision bf16 (where conv2d_relu_pool_takes_bf16): the kernels run on x and w (and, backward,
// dpooled) rounded to bfloat16, which gives the bits of conv2d's bf16 passes under algo followed
// by relu and avg_pool2d: those run float32's rule on the rounded operands (ops/bf16.h), and
// rounding dy = mask * dpooled / pool^2 is rounding dpooled when pool^2 is a power of two (exact
// scaling; except for |dpooled| below 2^-124, where the scaled value is a float32 denormal that
// the rounding flushes), db included (the sum of the rounded dy).
Conv2dReluPool conv2d_relu_pool_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                        int64_t stride, int64_t pad, int64_t pool,
                                        bool keep_mask, Precision precision = Precision::F32);
// Given dpooled, returns dx (when need_dx), dw and db as conv2d_backward would for
// dy = relu_backward(y, avg_pool2d_backward(dpooled)), bit for bit.
Conv2dGrads conv2d_relu_pool_backward(const Tensor& x, const Tensor& w, const Tensor& mask,
                                      const Tensor& dpooled, int64_t stride, int64_t pad,
                                      int64_t pool, bool need_dx,
                                      Precision precision = Precision::F32);
// True where the kernels take precision bf16 for x (N, C, H, W) and w (K, C, R, S), stride 1, no
// padding, under algo: a CPU device, pool a power of two, and conv2d's bf16 passes running the
// shape's rule on rounded operands for that shape (cpu::bf16_rounds_for_rule), so the fused
// passes compute conv2d's bits.
bool conv2d_relu_pool_takes_bf16(const Tensor& x, const Tensor& w, int64_t pool, ConvAlgo algo);

namespace cpu {
// Computed block by block while the conv's product is in cache. mask and b may be null.
// Preconditions: conv2d's, and 1 <= pool <= min(P, Q). bf16: the conv runs as conv2d's bf16
// pass under the rule (cpu::bf16_rounds_for_rule's shapes), rounding x in its blocks; w (and, in
// backward, dpooled) must come rounded to bfloat16; hardware_dot as bf16.h's.
void conv2d_relu_pool_forward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                              const float* b, uint8_t* mask, float* pooled, bool bf16 = false,
                              bool hardware_dot = false);
// Writes dx, dw, db without materialising dy; dx and db may be null.
void conv2d_relu_pool_backward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                               const uint8_t* mask, const float* dpooled, float* dx, float* dw,
                               float* db, bool bf16 = false, bool hardware_dot = false);
}  // namespace cpu

}  // namespace mgpu::ops
