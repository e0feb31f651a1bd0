// cpp/train/lenet.h -- the chapter's toy network (sec. 12.5.3) as one Model (model.h, lenet_model).
// params: W1 (20, 1, 3, 3), b1 (20,), W2 (50, 20, 5, 5), b2 (50,), W3 (800, 128), b3 (128,),
// W4 (128, 10), b4 (10,). Its layers run exactly the ops the Python autograd records for
// mgpu.lenet (conv, relu and pool fused on CPU devices, with the same bits), so the fused step and
// the chapter's op-by-op step compute the same numbers (in bf16 too, the op-by-op step under
// mgpu.autocast("bf16")).
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/precision.h"
#include "train/model.h"

namespace mgpu::train {

// Checks that params are the chapter's 8 float32 arrays with consistent shapes on one device.
void check_lenet_params(const char* op, const std::vector<Tensor>& params);
// LeNet as a model: conv 3x3 + relu + avg-pool 2 and conv 5x5 + relu + avg-pool 2 (each one fused
// layer), flatten, linear (W (in, out)) + relu, linear. One Model per set of parameter shapes,
// device kind and precision. precision BF16: the two convs' and the two linear layers' products
// (forward, data and weight gradients) take bfloat16 operands with float32 sums (ops/bf16.h);
// the convs then run unfused (conv2d + bias, relu, avg_pool2d: conv2d_relu_pool's kernel is
// float32 only); relu, pooling, the loss, the sums across replicas and SGD stay float32.
const Model& lenet_model(const std::vector<Tensor>& params,
                         ops::Precision precision = ops::Precision::F32);
// The logits (N, 10) of X (N, 1, 28, 28).
Tensor lenet_forward(const Tensor& X, const std::vector<Tensor>& params);

// The chapter's LeNet step: params[d] is device d's replica (W1, b1, ..., W4, b4 on devices[d]),
// updated in place with p -= lr / N * g. num_shards and accumulate as for train_step
// (train_batch.h); precision as for lenet_model (the parameters stay float32 master weights).
std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr,
                                int64_t num_shards = 0, int64_t accumulate = 1,
                                ops::Precision precision = ops::Precision::F32);
std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices);

}  // namespace mgpu::train
