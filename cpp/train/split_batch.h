// cpp/train/split_batch.h -- distributing a minibatch over devices (sec. 12.5.5), in one process
// or over the devices of every rank of an mpirun world.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mgpu::train {

// The row ranges that split n examples over k devices: sizes differ by at most one, the first
// n % k shards taking one extra; with fewer examples than devices the last shards are empty.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t n, size_t k);

// x split along axis 0 over `total` shards; returns shards first .. first + devices.size() - 1,
// shard first + d copied to devices[d] (a view when x already lives there) when `place`, else
// left where x lives (a view).
std::vector<Tensor> take_shards(const Tensor& x, const std::vector<Device>& devices, size_t first,
                                size_t total, bool place);

// The chapter's split_batch: x over `devices`, one shard each.
std::vector<Tensor> split_rows(const Tensor& x, const std::vector<Device>& devices);

// In a multi-process world (mgpu.distributed, W ranks of L devices each) x is the global batch,
// the same on every rank, and this rank takes shards rank*L .. rank*L+L-1 of its split over W*L
// devices, so every rank computes its part of one step. With one process: split_rows.
std::vector<Tensor> rank_shards(const Tensor& x, const std::vector<Device>& devices, bool place);

}  // namespace mgpu::train
