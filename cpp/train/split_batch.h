// cpp/train/split_batch.h -- distributing a minibatch over devices (sec. 12.5.5).
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mgpu::train {

// The row ranges that split n examples over k devices: sizes differ by at most one, the first
// n % k shards taking one extra; with fewer examples than devices the last shards are empty.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t n, size_t k);

// Splits x along axis 0 and copies shard i to devices[i] (a view when x is already there).
std::vector<Tensor> split_rows(const Tensor& x, const std::vector<Device>& devices);

}  // namespace mgpu::train
