// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include <map>

#include "comm/allreduce_mpi.h"
#include "comm/bucket_allreduce.h"
#include "ops/argmax.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"
#include "train/graph_capture.h"
#include "train/lenet.h"
#include "train/shard_tree.h"
#include "train/split_batch.h"

namespace mgpu::train {
namespace {

std::vector<Device> devices_of(const std::vector<Replica>& replicas) {
  std::vector<Device> out;
  for (const Replica& r : replicas) out.push_back(r.device);
  return out;
}

// Parameter p's slice of a flat buffer laid out as the model's gradients.
Tensor view(const Model& m, const Tensor& flat, const Tensor& p, size_t i) {
  return flat.slice_rows(m.offset(i), m.offset(i) + p.numel()).reshape(p.shape());
}

void update(const Model& m, Replica& r, const Tensor& grads, const Sgd& sgd, int64_t batch) {
  const std::vector<Tensor>& ps = r.state.params;
  if (sgd.sum_rule) {
    const float scale = sgd.lr / static_cast<float>(batch);
    for (size_t i = 0; i < ps.size(); ++i) ops::sgd_update(ps[i], view(m, grads, ps[i], i), scale);
    return;
  }
  ops::binary_scalar_inplace(ops::BinaryOp::Div, grads, static_cast<float>(batch));
  if (sgd.weight_decay != 0.0f)
    for (size_t i = 0; i < ps.size(); ++i)
      ops::binary_inplace(ops::BinaryOp::Add, view(m, grads, ps[i], i),
                          ops::binary_scalar(ops::BinaryOp::Mul, ps[i], sgd.weight_decay, false));
  Tensor step = grads;
  if (sgd.momentum != 0.0f) {
    if (!r.momentum.defined()) {
      r.momentum = Tensor::empty({m.flat_size()}, DType::F32, r.device);
      ops::copy(r.momentum, grads);
    } else {
      ops::binary_scalar_inplace(ops::BinaryOp::Mul, r.momentum, sgd.momentum);
      ops::binary_inplace(ops::BinaryOp::Add, r.momentum, grads);
    }
    step = r.momentum;
  }
  for (size_t i = 0; i < ps.size(); ++i) ops::sgd_update(ps[i], view(m, step, ps[i], i), sgd.lr);
}

// Batch norm's running statistics are those of the first replica's shard (rank 0's under mpirun),
// as with PyTorch's DataParallel, and every replica keeps a copy of them.
void share_buffers(std::vector<Replica>& replicas) {
  const std::vector<Tensor>& first = replicas[0].state.buffers;
  if (first.empty()) return;
  if (comm::dist::world_size() > 1) comm::dist::broadcast(first, 0);
  for (size_t d = 1; d < replicas.size(); ++d)
    for (size_t j = 0; j < first.size(); ++j) ops::copy(replicas[d].state.buffers[j], first[j]);
}

// --- the deterministic step --------------------------------------------------------------------
// The sum of shards [span.first, span.second) of the summation tree: their flat gradients and
// their summed loss, on one device.
struct Partial {
  ShardSpan span;
  Tensor grads, loss;
};

// a += b, on a's device (b is copied there). Every node of the tree is formed by exactly this
// addition, left child plus right child, so the bits depend on the tree alone.
void add_into(Partial& a, const Partial& b) {
  MGPU_ASSERT(a.span.second == b.span.first, "adding shard sums out of tree order");
  ops::binary_inplace(ops::BinaryOp::Add, a.grads, ops::to_device(b.grads, a.grads.device()));
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

// One device's work: shards [lo, hi) (a tree node), each computed whole on the replica and summed
// pairwise in tree order. Only the batch's first shard moves batch norm's running statistics
// (the replica's own buffers); other shards write a scratch copy that nobody reads.
Partial local_sum(const Model& m, const Tensor& X, const Tensor& y,
                  const std::vector<ShardSpan>& rows, int64_t lo, int64_t hi, const Replica& r,
                  const ReplicaState& scratch) {
  if (hi - lo == 1) {
    const auto [begin, end] = rows[static_cast<size_t>(lo)];
    Partial p{{lo, hi}, Tensor::empty({m.flat_size()}, DType::F32, r.device), Tensor()};
    p.loss = model_loss_and_grads(m, ops::to_device(X.slice_rows(begin, end), r.device),
                                  ops::to_device(y.slice_rows(begin, end), r.device),
                                  lo == 0 ? r.state : scratch, p.grads, [](size_t) {});
    return p;
  }
  const int64_t mid = tree_split(lo, hi);
  Partial a = local_sum(m, X, y, rows, lo, mid, r, scratch);
  add_into(a, local_sum(m, X, y, rows, mid, hi, r, scratch));
  return a;
}

// The step with `num_shards` logical shards (see train_step): the shards go to the devices of
// all ranks in contiguous runs; each device sums its runs' tree nodes, this process joins its
// devices' nodes up the tree, the ranks exchange their top nodes (broadcasts from each rank, a
// list every rank can compute) and every rank forms the root identically.
std::vector<Tensor> sharded_sums(const Model& m, const Tensor& X, const Tensor& y,
                                 std::vector<Replica>& replicas, int64_t num_shards) {
  const size_t L = replicas.size();
  const int world = comm::dist::world_size(), me = comm::dist::rank();
  const std::vector<ShardSpan> rows = shard_ranges(X.size(0), static_cast<size_t>(num_shards));
  const std::vector<ShardSpan> owned = shard_ranges(num_shards, L * static_cast<size_t>(world));
  std::map<int64_t, Partial> have;
  for (size_t d = 0; d < L; ++d) {
    const Replica& r = replicas[d];
    ReplicaState scratch{r.state.params, {}};
    for (const Tensor& b : r.state.buffers) scratch.buffers.push_back(Tensor::empty_like(b));
    const auto [first, last] = owned[static_cast<size_t>(me) * L + d];
    for (const ShardSpan& n : maximal_nodes(num_shards, first, last))
      have.emplace(n.first, local_sum(m, X, y, rows, n.first, n.second, r, scratch));
  }
  const Device home = replicas[0].device;
  std::map<int64_t, Partial> top;
  for (int k = 0; k < world; ++k) {
    const int64_t first = owned[static_cast<size_t>(k) * L].first;
    const int64_t last = owned[static_cast<size_t>(k) * L + L - 1].second;
    for (const ShardSpan& n : maximal_nodes(num_shards, first, last)) {
      Partial p;
      if (k == me) {
        p = combine(n.first, n.second, have);
        p.grads = ops::to_device(p.grads, home);
        p.loss = ops::to_device(p.loss, home);
      } else {
        p = Partial{n, Tensor::empty({m.flat_size()}, DType::F32, home),
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
    ops::copy(r.grads, root.grads);
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

}  // namespace

void check_replicas(const char* op, const Model& m, const std::vector<Replica>& replicas) {
  MGPU_CHECK_VALUE(!replicas.empty(), op, ": the list of devices is empty");
  for (size_t d = 0; d < replicas.size(); ++d) {
    const Device dev = replicas[d].device;
    check_device(dev);
    MGPU_CHECK_VALUE(dev.is_cpu() == replicas[0].device.is_cpu(), op, ": devices ",
                     replicas[0].device, " and ", dev, " mix CPU and GPU devices; train on one "
                     "kind");
    for (size_t e = 0; e < d; ++e)
      MGPU_CHECK_VALUE(replicas[e].device != dev, op, ": two replicas are on ", dev,
                       "; pass each device once");
    m.check_replica(op, replicas[d].state.params, replicas[d].state.buffers, dev);
  }
}

std::vector<Tensor> train_step(const Model& m, const Tensor& X, const Tensor& y,
                               std::vector<Replica>& replicas, const Sgd& sgd,
                               int64_t num_shards) {
  check_replicas("train_step", m, replicas);
  MGPU_CHECK_VALUE(X.dim() >= 1 && y.dim() == 1 && X.size(0) == y.size(0), "train_step: X and "
                   "y must hold the same number of examples, got X ", X.shape(), " and y ",
                   y.shape());
  MGPU_CHECK_VALUE(X.size(0) > 0, "train_step: the minibatch is empty");
  MGPU_CHECK_VALUE(num_shards >= 0, "train_step: the number of logical shards must be >= 1 "
                   "(or 0: one shard per device), got ", num_shards);
  if (num_shards > 0) {
    std::vector<Tensor> losses = sharded_sums(m, X, y, replicas, num_shards);
    for (Replica& r : replicas) update(m, r, r.grads, sgd, X.size(0));
    share_buffers(replicas);
    return losses;
  }
  const std::vector<Device> devices = devices_of(replicas);
  const size_t L = devices.size(), world = static_cast<size_t>(comm::dist::world_size());
  // Graphs want every shard non-empty (an empty one takes the plain path's zero gradients).
  const bool graphs = graphs_enabled(devices) && X.size(0) >= static_cast<int64_t>(L * world);
  const std::vector<Tensor> xs = rank_shards(X, devices, !graphs), ys = rank_shards(y, devices, !graphs);
  std::vector<int64_t> sizes;
  for (const Bucket& b : m.buckets()) sizes.push_back(b.end - b.begin);
  comm::BucketAllReduce reduce(devices, sizes, X.size(0) * 256 + static_cast<int64_t>(L));
  std::vector<std::shared_ptr<CapturedStep>> loaded;
  for (size_t d = 0; graphs && d < L; ++d)
    loaded.push_back(load_captured_step(m, xs[d], ys[d], replicas[d].state, devices[d]));
  std::vector<Tensor> losses, grads;
  for (size_t d = 0; d < L; ++d) {
    Replica& r = replicas[d];
    if (!graphs && !r.grads.defined()) r.grads = Tensor::empty({m.flat_size()}, DType::F32, r.device);
    grads.push_back(graphs ? captured_grads(*loaded[d]) : r.grads);
    auto bucket_done = [&, d](size_t b) {
      reduce.ready(b, d, grads[d].slice_rows(m.buckets()[b].begin, m.buckets()[b].end));
    };
    losses.push_back(graphs ? replay_captured_step(loaded[d], devices[d], bucket_done)
                            : model_loss_and_grads(m, xs[d], ys[d], r.state, r.grads, bucket_done));
  }
  for (size_t d = 0; d < L; ++d) update(m, replicas[d], grads[d], sgd, X.size(0));
  share_buffers(replicas);
  return losses;
}

std::vector<Tensor> evaluate_step(const Model& m, const Tensor& X, const Tensor& y,
                                  const std::vector<Replica>& replicas) {
  check_replicas("evaluate_accuracy", m, replicas);
  MGPU_CHECK_VALUE(X.dim() >= 1 && y.dim() == 1 && X.size(0) == y.size(0), "evaluate_accuracy: "
                   "X and y must hold the same number of examples, got X ", X.shape(), " and y ",
                   y.shape());
  const std::vector<Device> devices = devices_of(replicas);
  std::vector<Tensor> xs = rank_shards(X, devices, true), ys = rank_shards(y, devices, true), counts;
  for (size_t d = 0; d < devices.size(); ++d) {
    if (xs[d].size(0) == 0) {
      counts.push_back(Tensor::empty({}, DType::F32, devices[d]));
      ops::fill(counts.back(), 0.0);
      continue;
    }
    counts.push_back(ops::correct_count(model_forward(m, xs[d], replicas[d].state, false), ys[d]));
  }
  return counts;
}

namespace {

std::vector<Replica> lenet_replicas(const char* op, const std::vector<std::vector<Tensor>>& params,
                                    const std::vector<Device>& devices) {
  MGPU_CHECK_VALUE(!devices.empty(), op, ": the list of devices is empty");
  MGPU_CHECK_VALUE(params.size() == devices.size(), op, ": got ", params.size(),
                   " parameter replicas for ", devices.size(), " devices; pass one replica per "
                   "device, e.g. [get_params(params, d) for d in devices]");
  std::vector<Replica> out;
  for (size_t d = 0; d < devices.size(); ++d) {
    check_lenet_params(op, params[d]);
    MGPU_CHECK_VALUE(params[d][0].device() == devices[d], op, ": replica ", d, " lives on ",
                     params[d][0].device(), " but devices[", d, "] is ", devices[d]);
    out.push_back(Replica{devices[d], ReplicaState{params[d], {}}, Tensor(), Tensor()});
  }
  return out;
}

}  // namespace

std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr,
                                int64_t num_shards) {
  std::vector<Replica> replicas = lenet_replicas("train_batch", params, devices);
  require_dtype("train_batch", "X", X, DType::F32);
  MGPU_CHECK_VALUE(X.dim() == 4, "train_batch: X must have 4 dims (N, 1, 28, 28), got shape ",
                   X.shape());
  Sgd sgd;
  sgd.lr = lr;
  sgd.sum_rule = true;
  return train_step(lenet_model(params[0]), X, y, replicas, sgd, num_shards);
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  std::vector<Replica> replicas = lenet_replicas("evaluate_accuracy", params, devices);
  return evaluate_step(lenet_model(params[0]), X, y, replicas);
}

}  // namespace mgpu::train
