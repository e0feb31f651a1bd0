// cpp/train/shard_tree.h -- the fixed summation tree of the deterministic step: a global batch is
// cut into S logical shards (shard_ranges(N, S)), whatever the device count, and their gradients
// are added in one binary tree over shard indices 0..S-1 that depends on S alone.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace mgpu::train {

using ShardSpan = std::pair<int64_t, int64_t>;  // shards [first, last)

// Node [lo, hi) (hi - lo >= 2) has children [lo, m) and [m, hi) with m = lo + the largest power of
// two below hi - lo: the left child is a complete, aligned binary tree, so adding them pairwise
// is the classic pairwise sum.
int64_t tree_split(int64_t lo, int64_t hi);

// The largest nodes of the tree over [0, num_shards) that lie inside [first, last), left to
// right. A device holding shards [first, last) sums each of these locally; the nodes above them
// join partial sums of several devices.
std::vector<ShardSpan> maximal_nodes(int64_t num_shards, int64_t first, int64_t last);

}  // namespace mgpu::train
