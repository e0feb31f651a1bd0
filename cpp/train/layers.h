// cpp/train/layers.h -- one replica's pass through a Model: forward, loss, backward, all through the
// ops API (train never calls a kernel). Everything is enqueued on the replica's device; the calls
// return at once.
#pragma once

#include <functional>
#include <vector>

#include "train/model.h"

namespace mgpu::train {

// A replica: the parameters and buffers (BN running statistics) on one device.
struct ReplicaState {
  std::vector<Tensor> params, buffers;
};

// The logits of X. training = true uses batch statistics in batch norm (and updates the running
// ones), false the running statistics.
Tensor model_forward(const Model& m, const Tensor& X, const ReplicaState& r, bool training);

// Forward in training mode, per-example softmax cross-entropy, backward of the summed loss.
// Parameter p's gradient is written to grads[offset(p), offset(p) + numel) (a flat float32
// buffer of m.flat_size() on the replica's device); bucket_done(b) is called, in bucket order,
// as soon as bucket b's gradients are enqueued. Returns the summed loss (0-d). An empty batch
// gives zero gradients and loss.
Tensor model_loss_and_grads(const Model& m, const Tensor& X, const Tensor& y, const ReplicaState& r,
                            const Tensor& grads, const std::function<void(size_t)>& bucket_done);

}  // namespace mgpu::train
