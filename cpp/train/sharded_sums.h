// cpp/train/sharded_sums.h -- the deterministic step's gradients: the batch cut into logical
// shards, each shard's forward and backward run whole on one device, and the shard gradients and
// losses added in the fixed tree of shard_tree.h, so the sum's bits depend on the shard count
// alone (not on the devices, the ranks or the micro-batches).
#pragma once

#include <cstdint>
#include <vector>

#include "train/model.h"
#include "train/train_batch.h"

namespace mgpu::train {

// The step with `num_shards` logical shards (see train_step), in `accumulate` micro-batches of
// num_shards / accumulate shards run one after another: micro-batch k is shards [k S/K,
// (k + 1) S/K), which go to the devices of all ranks in contiguous runs; each device sums its
// runs' tree nodes and keeps them. Once every micro-batch has run, this process joins its
// devices' nodes up the tree, the ranks exchange their top nodes (broadcasts from each rank, a
// list every rank can compute) and every rank forms the root identically: the tree and its
// additions are those of one batch, so the bits do not depend on `accumulate` either. The root's
// gradients land in every replica's grads; returns the losses (the whole batch's on rank 0's
// first replica, 0 on every other). seed: the step's dropout masks, each shard's rows masked as
// rows of X. comm_dtype BF16: every node of the tree is rounded to bfloat16 as it is formed (a
// shard's gradients; a partial sum after its float32 addition), so partial sums cross devices
// and ranks in half the bytes (train_step's comm_dtype).
std::vector<Tensor> sharded_sums(const Model& m, const Tensor& X, const Tensor& y,
                                 std::vector<Replica>& replicas, int64_t num_shards,
                                 int64_t accumulate, uint64_t seed,
                                 DType comm_dtype = DType::F32);

}  // namespace mgpu::train
