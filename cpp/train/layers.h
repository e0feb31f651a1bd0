// cpp/train/layers.h -- one replica's pass through a Model: forward, loss, backward, all through the
// ops API (train never calls a kernel). Everything is enqueued on the replica's device; the calls
// return at once.
#pragma once

#include <functional>
#include <vector>

#include "train/model.h"

namespace mgpu::train {

// The logits of X. training = true uses batch statistics in batch norm (and updates the running
// ones) and dropout's masks of seed 0, false the running statistics and no dropout.
Tensor model_forward(const Model& m, const Tensor& X, const ReplicaState& r, bool training);

// How a step's replicas meet at synchronised batch norm layers. `slots` is the number of replicas
// of the whole step (every rank's, under mpirun), slot[d] local replica d's place among them and
// rows the examples of the whole step's batch; sum(parts, tag) adds parts[0..L) (one float32 1-D
// tensor per local replica, on its device) over every replica of the step, in place, enqueued on
// the devices' queues (tag labels the collective). With one slot a synchronised layer is a plain
// one.
struct SyncReplicas {
  size_t slots = 1;
  int64_t rows = 0;  // examples in the whole step's batch
  std::vector<size_t> slot;
  std::function<void(const std::vector<Tensor>&, int64_t tag)> sum;
};

// Where a step's dropout masks come from (ops/dropout.h): the step's seed and, per replica, the
// index of its first example in the step's whole batch (every micro-batch's and rank's rows
// counted), so an example's masks do not depend on the device, rank or micro-batch computing it.
struct StepRows {
  uint64_t seed = 0;
  std::vector<int64_t> first_row;  // per replica; empty: 0 for every replica
};

// Forward in training mode, per-example softmax cross-entropy, backward of the summed loss, for
// every replica d (X[d], y[d] on its device; an empty shard gives zero gradients and loss).
// Replicas advance layer by layer together, so synchronised batch norm layers can exchange their
// statistics (sync, needed when some layer is synchronised and sync.slots > 1). Parameter p's
// gradient is written to grads[d][offset(p), offset(p) + numel) (a flat float32 buffer of
// m.flat_size() on replica d's device); bucket_done(b, d) is called, in bucket order for each d,
// as soon as bucket b's gradients are enqueued, at the same layer for every replica. Returns each
// replica's summed loss (0-d).
std::vector<Tensor> replicas_loss_and_grads(
    const Model& m, const std::vector<Tensor>& X, const std::vector<Tensor>& y,
    const std::vector<const ReplicaState*>& r, const std::vector<Tensor>& grads,
    const std::function<void(size_t, size_t)>& bucket_done, const SyncReplicas& sync,
    const StepRows& rows = {});

// One replica alone (synchronised layers act as plain ones): one shard of the deterministic step
// (its first example at row first_row of the step's batch), the step of a captured CUDA graph.
Tensor model_loss_and_grads(const Model& m, const Tensor& X, const Tensor& y, const ReplicaState& r,
                            const Tensor& grads, const std::function<void(size_t)>& bucket_done,
                            uint64_t seed = 0, int64_t first_row = 0);

}  // namespace mgpu::train
