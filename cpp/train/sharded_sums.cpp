// cpp/train/sharded_sums.cpp -- the deterministic step's shard sums over the tree of
// shard_tree.h (see sharded_sums.h).
#include "train/sharded_sums.h"

#include <map>
#include <utility>

#include "comm/allreduce_mpi.h"
#include "comm/collective_counts.h"
#include "ops/elementwise.h"
#include "train/layers.h"
#include "train/shard_tree.h"
#include "train/split_batch.h"

namespace mgpu::train {
namespace {

// The sum of shards [span.first, span.second) of the summation tree: their flat gradients and
// their summed loss, on one device.
struct Partial {
  ShardSpan span;
  Tensor grads, loss;
};

// a += b, on a's device (b is copied there). Every node of the tree is formed by exactly this
// addition, left child plus right child, so the bits depend on the tree alone. bfloat16 children
// (comm_dtype) are added in float32 and the sum rounded to bfloat16.
void add_into(Partial& a, const Partial& b) {
  MGPU_ASSERT(a.span.second == b.span.first, "adding shard sums out of tree order");
  if (b.grads.device() != a.grads.device())
    comm::count_collective(static_cast<int64_t>(b.grads.nbytes()));
  if (a.grads.dtype() == DType::BF16) {
    Tensor sum = ops::astype(a.grads, DType::F32);
    ops::binary_inplace(ops::BinaryOp::Add, sum,
                        ops::astype(ops::to_device(b.grads, a.grads.device()), DType::F32));
    a.grads = ops::astype(sum, DType::BF16);
  } else {
    ops::binary_inplace(ops::BinaryOp::Add, a.grads, ops::to_device(b.grads, a.grads.device()));
  }
  ops::binary_inplace(ops::BinaryOp::Add, a.loss, ops::to_device(b.loss, a.loss.device()));
  a.span.second = b.span.second;
}

// The tree node [lo, hi), from the partial sums in `have` (tree nodes covering it, keyed by
// their first shard): a node found there is taken, any other is formed from its two children.
Partial combine(int64_t lo, int64_t hi, std::map<int64_t, Partial>& have) {
  auto it = have.find(lo);
  if (it != have.end() && it->second.span.second == hi) return it->second;
  MGPU_ASSERT(hi - lo >= 2, "shard ", lo, " has no partial sum");
  const int64_t mid = tree_split(lo, hi);
  Partial a = combine(lo, mid, have);
  add_into(a, combine(mid, hi, have));
  return a;
}

// One device's work: shards [lo, hi) (a tree node), each computed whole on the replica from its
// rows in `inputs` (already on the replica's device) and summed pairwise in tree order. Only
// shard `stats` (a micro-batch's first) moves batch norm's running statistics (the replica's own
// buffers); other shards write a scratch copy that nobody reads. Dropout's masks take the step's
// seed and each shard's first row in the batch (rows[shard].first).
Partial local_sum(const Model& m, const std::vector<std::pair<Tensor, Tensor>>& inputs,
                  int64_t lo, int64_t hi, const Replica& r, const ReplicaState& scratch,
                  int64_t stats, const std::vector<ShardSpan>& rows, uint64_t seed,
                  DType comm_dtype) {
  if (hi - lo == 1) {
    const auto& [Xs, ys] = inputs[static_cast<size_t>(lo)];
    Partial p{{lo, hi}, Tensor::empty({m.flat_size()}, DType::F32, r.device), Tensor()};
    p.loss = model_loss_and_grads(m, Xs, ys, lo == stats ? r.state : scratch, p.grads,
                                  [](size_t) {}, seed, rows[static_cast<size_t>(lo)].first);
    if (comm_dtype == DType::BF16) p.grads = ops::astype(p.grads, DType::BF16);
    return p;
  }
  const int64_t mid = tree_split(lo, hi);
  Partial a = local_sum(m, inputs, lo, mid, r, scratch, stats, rows, seed, comm_dtype);
  add_into(a, local_sum(m, inputs, mid, hi, r, scratch, stats, rows, seed, comm_dtype));
  return a;
}

}  // namespace

std::vector<Tensor> sharded_sums(const Model& m, const Tensor& X, const Tensor& y,
                                 std::vector<Replica>& replicas, int64_t num_shards,
                                 int64_t accumulate, uint64_t seed, DType comm_dtype) {
  const size_t L = replicas.size();
  const int world = comm::dist::world_size(), me = comm::dist::rank();
  const std::vector<ShardSpan> rows = shard_ranges(X.size(0), static_cast<size_t>(num_shards));
  const int64_t per = num_shards / accumulate;
  const std::vector<ShardSpan> runs = shard_ranges(per, L * static_cast<size_t>(world));
  // Global device g's shards in micro-batch k (device 0 of rank 0 always has the first).
  auto owned = [&](int64_t k, size_t g) {
    return ShardSpan{k * per + runs[g].first, k * per + runs[g].second};
  };
  // Every shard's rows go to the device that computes it before any shard's work is enqueued: a
  // copy between two devices waits for the source device's earlier work, so a device's rows
  // copied after another device's shards were enqueued would hold it until those had run.
  std::vector<std::pair<Tensor, Tensor>> inputs(static_cast<size_t>(num_shards));
  for (int64_t k = 0; k < accumulate; ++k) {
    for (size_t d = 0; d < L; ++d) {
      const auto [first, last] = owned(k, static_cast<size_t>(me) * L + d);
      const Device to = replicas[d].device;
      for (int64_t i = first; i < last; ++i) {
        const auto [begin, end] = rows[static_cast<size_t>(i)];
        inputs[static_cast<size_t>(i)] = {ops::to_device(X.slice_rows(begin, end), to),
                                          ops::to_device(y.slice_rows(begin, end), to)};
      }
    }
  }
  std::vector<ReplicaState> scratch;
  for (const Replica& r : replicas) {
    scratch.push_back(ReplicaState{r.state.params, {}});
    for (const Tensor& b : r.state.buffers) scratch.back().buffers.push_back(Tensor::empty_like(b));
  }
  std::map<int64_t, Partial> have;
  for (int64_t k = 0; k < accumulate; ++k) {
    for (size_t d = 0; d < L; ++d) {
      const auto [first, last] = owned(k, static_cast<size_t>(me) * L + d);
      for (const ShardSpan& n : maximal_nodes(num_shards, first, last))
        have.emplace(n.first, local_sum(m, inputs, n.first, n.second, replicas[d], scratch[d],
                                        k * per, rows, seed, comm_dtype));
      for (int64_t i = first; i < last; ++i) inputs[static_cast<size_t>(i)] = {};
    }
  }
  const Device home = replicas[0].device;
  std::map<int64_t, Partial> top;
  for (int k = 0; k < world; ++k) {
    // Rank k's shards: a run per micro-batch, runs that touch joined.
    std::vector<ShardSpan> spans;
    for (int64_t j = 0; j < accumulate; ++j) {
      const ShardSpan run{owned(j, static_cast<size_t>(k) * L).first,
                          owned(j, static_cast<size_t>(k) * L + L - 1).second};
      if (!spans.empty() && spans.back().second == run.first) spans.back().second = run.second;
      else spans.push_back(run);
    }
    std::vector<ShardSpan> nodes;
    for (const ShardSpan& sp : spans)
      for (const ShardSpan& n : maximal_nodes(num_shards, sp.first, sp.second)) nodes.push_back(n);
    for (const ShardSpan& n : nodes) {
      Partial p;
      if (k == me) {
        p = combine(n.first, n.second, have);
        p.grads = ops::to_device(p.grads, home);
        p.loss = ops::to_device(p.loss, home);
      } else {
        p = Partial{n, Tensor::empty({m.flat_size()}, comm_dtype, home),
                    Tensor::empty({}, DType::F32, home)};
      }
      if (world > 1) comm::dist::broadcast({p.grads, p.loss}, k);
      top.emplace(n.first, p);
    }
  }
  const Partial root = combine(0, num_shards, top);
  std::vector<Tensor> losses;
  for (size_t d = 0; d < L; ++d) {
    Replica& r = replicas[d];
    if (!r.grads.defined()) r.grads = Tensor::empty({m.flat_size()}, DType::F32, r.device);
    // A bfloat16 root goes to each replica's device as bfloat16 and is widened there.
    ops::copy(r.grads, root.grads.dtype() == DType::BF16
                           ? ops::astype(ops::to_device(root.grads, r.device), DType::F32)
                           : root.grads);
    // The whole batch's loss is reported once (by rank 0's first replica), so the sums over
    // replicas and ranks that callers form are the tree's sum exactly.
    Tensor loss = Tensor::empty({}, DType::F32, r.device);
    if (d == 0 && me == 0)
      ops::copy(loss, root.loss);
    else
      ops::fill(loss, 0.0);
    losses.push_back(loss);
  }
  return losses;
}

}  // namespace mgpu::train
