// cpp/train/optimizer_step.h -- the fused step's update (Sgd, train_batch.h) of the replicas'
// parameters and optimizer state from their summed flat gradients: one replica at a time, or all
// CPU replicas of a process at once in the shared update (comm/shared_update.h), with the same
// bits; and the copy of batch norm's running statistics between replicas after a step.
#pragma once

#include <cstdint>
#include <vector>

#include "train/model.h"
#include "train/train_batch.h"

namespace mgpu::train {

// The update of replica r with its summed flat gradients `grads` over `batch` examples. The
// optimizer state (momentum, Adam's moments) is made, zeroed, at the first step that needs it.
void update(const Model& m, Replica& r, const Tensor& grads, const Sgd& sgd, int64_t batch);

// The gradient sum and update of every replica (CPU devices of one process) as one collective,
// enqueued on every replica's device: grads[d] is replica d's flat gradients.
void shared_update(const Model& m, std::vector<Replica>& replicas, const std::vector<Tensor>& grads,
                   const Sgd& sgd, int64_t batch);

// Every replica (and every rank) gets the first replica's batch-norm running statistics.
void share_buffers(std::vector<Replica>& replicas);

}  // namespace mgpu::train
