// cpp/train/shard_tree.cpp -- the deterministic step's summation tree (see shard_tree.h).
#include "train/shard_tree.h"

#include "core/error.h"

namespace mgpu::train {
namespace {

void collect(int64_t lo, int64_t hi, int64_t first, int64_t last, std::vector<ShardSpan>* out) {
  if (hi <= first || lo >= last) return;
  if (first <= lo && hi <= last) {
    out->emplace_back(lo, hi);
    return;
  }
  const int64_t m = tree_split(lo, hi);
  collect(lo, m, first, last, out);
  collect(m, hi, first, last, out);
}

}  // namespace

int64_t tree_split(int64_t lo, int64_t hi) {
  MGPU_ASSERT(hi - lo >= 2, "tree_split of a node with fewer than two shards");
  int64_t p = 1;
  while (2 * p < hi - lo) p *= 2;
  return lo + p;
}

std::vector<ShardSpan> maximal_nodes(int64_t num_shards, int64_t first, int64_t last) {
  std::vector<ShardSpan> out;
  if (first < last) collect(0, num_shards, first, last, &out);
  return out;
}

}  // namespace mgpu::train
