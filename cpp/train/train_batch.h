// cpp/train/train_batch.h -- the fused data-parallel step (sec. 12.5.6, 12.6) in one call: split
// the minibatch over the replicas, run forward, loss and backward on every device at once, sum the
// gradients bucket by bucket as backward produces them, and let every replica take the same step.
#pragma once

#include <vector>

#include "train/layers.h"
#include "train/model.h"

namespace mgpu::train {

// One device's copy of the model and its training state.
struct Replica {
  Device device;
  ReplicaState state;
  Tensor grads;       // flat (Model::flat_size()), made at the first step
  Tensor momentum;    // flat like grads: SGD's momentum, or Adam's first moment m; undefined
                      // until the first step that needs it (or a set)
  Tensor second;      // flat like grads: Adam's second moment v, undefined as momentum
  Tensor max_second;  // flat like grads: amsgrad's running maximum of v, undefined as momentum
};

// The update. sum_rule (the chapter's LeNet step): p -= lr / N * g with g the gradient of the
// summed loss and N the global batch. Otherwise PyTorch's optimizers on the mean loss over the
// global batch, g = g_sum / N: with clip first clip_grad_norm_(max_norm) over the whole
// flat gradient (g *= min(1, max_norm / (||g|| + 1e-6)), the same factor on every replica as
// their gradients are the same sum); then kind Sgd: g += weight_decay * p; buf = momentum * buf
// + g (buf = g at the first step); p -= lr * buf (p -= lr * g when momentum is 0); kind Adam or
// AdamW: ops::AdamStep at step `step` (counted from 1), with amsgrad PyTorch's variant (the
// denominator from the running maximum of v). lrs, weight_decays: per parameter (a PyTorch
// parameter group's values for its parameters), empty for lr and weight_decay everywhere.
// The global norm's squares are summed as ops::clip_factor sums them on each device kind (on CPU
// devices in fixed blocks, so the same bits whether one replica sums all or the shared update
// splits the blocks over the devices).
struct Sgd {
  float lr = 0.1f, momentum = 0.0f, weight_decay = 0.0f;
  bool sum_rule = false;
  enum class Kind : int8_t { Sgd, Adam, AdamW } kind = Kind::Sgd;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  bool amsgrad = false;
  int64_t step = 1;
  bool clip = false;
  float max_norm = 0.0f;
  std::vector<float> lrs, weight_decays;
  // The dtype the gradients are reduced in across replicas: F32, or BF16 (half the bytes; see
  // train_step).
  DType comm_dtype = DType::F32;

  float lr_of(size_t i) const { return lrs.empty() ? lr : lrs[i]; }
  float weight_decay_of(size_t i) const {
    return weight_decays.empty() ? weight_decay : weight_decays[i];
  }
  bool adam() const { return kind != Kind::Sgd; }
};

// Checks the replicas against the model and each other (distinct devices of one kind).
void check_replicas(const char* op, const Model& m, const std::vector<Replica>& replicas);

// Returns each replica's summed loss (0-d tensors, computed asynchronously). In a multi-process
// world (comm/allreduce_mpi.h) X, y are the global batch on every rank; each rank trains on its
// rows and the gradients are summed across processes too, so every rank takes the same step.
// num_shards 0: one shard per device (of every rank), batch norm per replica, gradients summed
// bucket by bucket as backward produces them. num_shards S > 0, the deterministic step: the
// batch is cut into S logical shards (shard_ranges(N, S)) whatever the devices; each shard's
// forward and backward runs whole on one device (devices of ranks 0, 1, ... take contiguous runs
// of shards), batch norm normalises per shard and takes its running statistics from shard 0,
// and shard gradients and losses are added in the fixed tree of shard_tree.h. So any number of
// devices and ranks of one kind gives bitwise the same parameters; the whole loss is reported by
// rank 0's first replica, every other replica reports 0.
// accumulate K > 1: gradient accumulation in one call, for K times less activation memory. The
// batch runs as K micro-batches one after another (forward and backward each), their gradients
// summed on every device, and only then reduced across devices and ranks and applied in one
// update with the scale of the whole batch (the mean loss over X), so K micro-batches compute the
// step of one batch. Batch norm normalises per micro-batch (per replica, or per shard) and its
// running statistics move once per micro-batch, as PyTorch's do when a loop accumulates. With
// num_shards 0 micro-batch k is rows shard_ranges(N, K)[k]; with num_shards S (K must divide S,
// else ValueError) it is shards [k S/K, (k + 1) S/K), spread over every device, and the shard
// gradients are added in the same tree as with K = 1: the parameters are bitwise those of K = 1.
// Atomic for labels outside the logits' classes (a model whose last layer is linear): labels the
// host can read raise IndexError before anything changes; labels on a device leave parameters,
// momentum and batch-norm statistics as they were, and the IndexError comes at the next wait (the
// returned losses keep it). Errors name `op`. seed: the step's dropout masks, a function of
// (seed, layer, the example's row in X, element) however the batch is split (ops/dropout.h).
// sgd.comm_dtype BF16: the gradients are reduced in bfloat16. Each replica rounds its gradients
// to bfloat16 (dtype.h: nearest, ties to even) and the others read those, half the bytes; the
// sum is formed in float32 in device order and rounded to bfloat16 once more (what an all-gather
// in bfloat16 carries), and every replica's update reads it widened. The deterministic step
// rounds every node of its tree instead: a shard's gradients, and each partial sum as it is
// formed (left + right in float32, then rounded); partial sums cross devices and ranks as
// bfloat16. So the bits still depend on the shard count alone. Without shards every path keeps
// the rounding and the order: the CPU devices' shared update, their bucketed all-reduce
// (MGPU_CPU_SHARED_UPDATE=0: the same bits), GPUs (the peer copies; NCCL's ncclBfloat16 sums)
// and mpirun's ranks (rank order; with several devices per rank, each rank's sum is rounded
// before the ranks add them): comm/bucket_allreduce.cpp. On one device nothing is reduced.
std::vector<Tensor> train_step(const Model& m, const Tensor& X, const Tensor& y,
                               std::vector<Replica>& replicas, const Sgd& sgd,
                               int64_t num_shards = 0, const char* op = "train_step",
                               int64_t accumulate = 1, uint64_t seed = 0);
// Correct predictions (batch norm in evaluation mode), one 0-d float32 count per replica; across
// processes each rank counts its rows only.
std::vector<Tensor> evaluate_step(const Model& m, const Tensor& X, const Tensor& y,
                                  const std::vector<Replica>& replicas);

// Fault injection for tests: the next bucketed step (num_shards 0) on several devices or ranks
// throws OutOfMemoryError on the host right after every device has passed bucket `bucket` to
// the all-reduce, as an allocation in the next layer's backward would; -1 (the default) turns it
// off. Once only: the step after the failing one runs as usual.
void fail_next_step_after_bucket(int64_t bucket);

}  // namespace mgpu::train
