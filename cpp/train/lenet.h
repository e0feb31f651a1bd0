// cpp/train/lenet.h -- the chapter's toy network (sec. 12.5.3), composed from mgpu's ops.
// params: W1 (20, 1, 3, 3), b1 (20,), W2 (50, 20, 5, 5), b2 (50,), W3 (800, 128), b3 (128,),
// W4 (128, 10), b4 (10,). X (N, 1, 28, 28) -> conv 3x3, relu, avg-pool 2 -> conv 5x5, relu,
// avg-pool 2 -> flatten (N, 800) -> dense, relu -> dense -> logits (N, 10).
// These are exactly the ops the Python autograd records for mgpu.lenet, in the same order, so
// the fused step and the chapter's op-by-op step compute the same numbers.
#pragma once

#include <functional>
#include <vector>

#include "core/tensor.h"

namespace mgpu::train {

constexpr size_t kLeNetParams = 8;

// Checks that params are the chapter's 8 float32 arrays with consistent shapes on one device.
void check_lenet_params(const char* op, const std::vector<Tensor>& params);
Tensor lenet_forward(const Tensor& X, const std::vector<Tensor>& params);

struct LeNetStep {
  std::vector<Tensor> grads;  // d(sum of per-example losses)/d(param), one per parameter
  Tensor loss_sum;            // 0-d
};
// Called once in the middle of backward, as soon as the dense layers' gradients (W3, b3, W4, b4)
// are enqueued and before the conv layers' are: a step can start reducing them meanwhile.
using DenseGradsReady = std::function<void(const std::vector<Tensor>& dense_grads)>;
// Forward, per-example softmax cross-entropy, backward of the summed loss. Enqueued on the
// params' device; returns at once. An empty batch gives zero gradients.
LeNetStep lenet_loss_and_grads(const Tensor& X, const Tensor& y, const std::vector<Tensor>& params,
                               const DenseGradsReady& dense_ready = nullptr);

}  // namespace mgpu::train
