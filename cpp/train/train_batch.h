// cpp/train/train_batch.h -- the fused data-parallel step (sec. 12.5.6) in one call.
// Split the minibatch over the devices, run forward, loss and backward on every device at once,
// sum the gradients across devices (one flat all-reduce), and take the same SGD step on every
// replica: p -= lr / N * g with N the full minibatch size, as the chapter does.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mgpu::train {

// params[d] is device d's replica (LeNet's 8 arrays on devices[d]); updated in place. Returns
// each device's summed loss (0-d tensors, computed asynchronously). In a multi-process world
// (comm/allreduce_mpi.h) X, y are the global batch on every rank; each rank trains on its rows
// and the gradients are summed across processes too, so every rank takes the same global step.
std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr);

// Counts correct predictions of the replicas on one batch, split over the devices; returns one
// 0-d float32 count per device. Across processes each rank counts its rows only (sum the ranks').
std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices);

}  // namespace mgpu::train
