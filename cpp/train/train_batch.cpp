// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "comm/allreduce_mpi.h"
#include "comm/barrier.h"
#include "comm/bucket_allreduce.h"
#include "comm/collective_counts.h"
#include "comm/stream_sum.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "core/queue.h"
#include "core/trace.h"
#include "ops/argmax.h"
#include "ops/dispatch.h"
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

// A flat buffer like the gradients, zeroed: a zeroed momentum buffer makes the first step
// PyTorch's buf = g, zeroed moments make Adam's first step PyTorch's.
void make_zeroed(const Model& m, Tensor& t, Device device) {
  if (t.defined()) return;
  t = Tensor::empty({m.flat_size()}, DType::F32, device);
  ops::fill(t, 0.0);
}

ops::AdamHyper adam_hyper(const Sgd& sgd, size_t i) {
  ops::AdamHyper h;
  h.lr = sgd.lr_of(i);
  h.beta1 = sgd.beta1;
  h.beta2 = sgd.beta2;
  h.eps = sgd.eps;
  h.weight_decay = sgd.weight_decay_of(i);
  h.decoupled = sgd.kind == Sgd::Kind::AdamW;
  h.step = sgd.step;
  return h;
}

void update(const Model& m, Replica& r, const Tensor& grads, const Sgd& sgd, int64_t batch) {
  const std::vector<Tensor>& ps = r.state.params;
  if (sgd.sum_rule) {
    const float scale = sgd.lr / static_cast<float>(batch);
    for (size_t i = 0; i < ps.size(); ++i) ops::sgd_update(ps[i], view(m, grads, ps[i], i), scale);
    return;
  }
  // Every replica holds the same summed gradients, so each forms the same clip factor itself.
  const Tensor clip = sgd.clip ? ops::clip_factor(grads, 1.0f / static_cast<float>(batch),
                                                  sgd.max_norm)
                               : Tensor();
  if (sgd.adam()) {
    make_zeroed(m, r.momentum, r.device);
    make_zeroed(m, r.second, r.device);
    if (sgd.amsgrad) make_zeroed(m, r.max_second, r.device);
    for (size_t i = 0; i < ps.size(); ++i)
      ops::adam_step(ps[i], view(m, grads, ps[i], i), view(m, r.momentum, ps[i], i),
                     view(m, r.second, ps[i], i), static_cast<float>(batch), adam_hyper(sgd, i),
                     clip, sgd.amsgrad ? view(m, r.max_second, ps[i], i) : Tensor());
    return;
  }
  // One pass per parameter, nothing allocated but the clip factor.
  const bool with_buf = sgd.momentum != 0.0f;
  if (with_buf) make_zeroed(m, r.momentum, r.device);
  for (size_t i = 0; i < ps.size(); ++i) {
    const Tensor buf = with_buf ? view(m, r.momentum, ps[i], i) : Tensor();
    ops::sgd_step(ps[i], view(m, grads, ps[i], i), buf, static_cast<float>(batch), sgd.lr_of(i),
                  sgd.momentum, sgd.weight_decay_of(i), clip);
  }
}

// --- the shared update of CPU replicas ---------------------------------------------------------
// CPU devices of one process share memory, so their gradient sum and their updates run as one
// collective after backward instead of a bucketed all-reduce (reduce-scatter, all-gather) followed
// by every replica updating all of its parameters: the flat gradients are cut into blocks of
// ops::kElementBlock elements, device j of k takes the j-th of k runs of blocks, sums its blocks
// over the replicas, in device order as comm::allreduce adds, and applies the optimizer (SGD or
// Adam) to those elements of every replica's parameters and state with that sum. With clipping
// it first writes the sums into replica 0's gradients and each block's sum of squares
// (cpu::sum_squares, the blocks of cpu::sum_squares_blocks), meets the others, and adds the
// block sums in block order: the norm of ops::clip_factor, bit for bit. Each element gets the
// same operations on the same values as in the per-replica update, so every replica's parameters
// keep their bits; the other replicas' gradient buffers are left unsummed (nothing reads them
// after the step). It saves the all-gather, each device's writes of the summed gradients, and
// all but one or two of the collectives' meetings (one device waiting for the other at each
// bucket). MGPU_CPU_SHARED_UPDATE=0 (read at every step) keeps the bucketed all-reduce and the
// per-replica updates, for tests and benchmarks.
bool shared_update_enabled() {
  const char* env = std::getenv("MGPU_CPU_SHARED_UPDATE");
  return !env || std::strcmp(env, "0") != 0;
}

struct SharedUpdate {
  explicit SharedUpdate(int k) : barrier(k) {}
  std::vector<float*> grads;                  // grads[d]: replica d's flat gradients
  std::vector<std::vector<float*>> params;    // params[d][i]: replica d's parameter i
  // Per replica, flat, or null where the optimizer keeps none: SGD's momentum or Adam's m; v;
  // amsgrad's running maximum of v.
  std::vector<float*> momentum, second, max_second;
  // Parameter order[j] lies at flat [offsets[j], ends[j]), in flat order (the layout puts the
  // last layer's first, for the buckets).
  std::vector<size_t> order;
  std::vector<int64_t> offsets, ends;
  std::vector<ops::AdamStep> adam;            // per parameter: its Adam scalars (pointers null)
  std::vector<double> block_squares;          // with clipping: per block, its sum of squares
  int64_t total = 0;
  Sgd sgd;
  float batch = 1.0f;
  comm::Barrier barrier;

  // Flat elements [f0, f0 + n), one block: the optimizer on every replica, with the summed
  // gradients sum[0, n) and the clip factor (null: none).
  void update_block(int64_t f0, int64_t n, const float* sum, const float* clip) const {
    const int64_t f1 = f0 + n;
    const size_t first =
        static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), f0) - ends.begin());
    for (size_t j = first; j < offsets.size() && offsets[j] < f1; ++j) {
      const int64_t a = std::max(f0, offsets[j]), b = std::min(f1, ends[j]);
      if (a >= b) continue;  // a parameter without elements
      const size_t i = order[j];
      const float* g = sum + (a - f0);
      for (size_t d = 0; d < grads.size(); ++d) {
        float* p = params[d][i] + (a - offsets[j]);
        if (sgd.sum_rule) {
          const float scale = sgd.lr / batch;
          for (int64_t e = 0; e < b - a; ++e) p[e] -= scale * g[e];
        } else if (sgd.adam()) {
          ops::AdamStep step = adam[i];
          step.param = p;
          step.grad = g;
          step.m = momentum[d] + a;
          step.v = second[d] + a;
          step.vmax = max_second[d] ? max_second[d] + a : nullptr;
          step.clip = clip;
          ops::cpu::adam_step(0, b - a, step);
        } else {
          float* buf = momentum[d];
          ops::SgdStep step{p, g, buf ? buf + a : nullptr, batch, sgd.lr_of(i), sgd.momentum,
                            sgd.weight_decay_of(i), clip};
          for (int64_t e = 0; e < b - a; ++e) step(e);
        }
      }
    }
  }

  // sum[e] = the replicas' gradients at flat element f0 + e, added in device order.
  void sum_block(int64_t f0, int64_t n, float* sum) const {
    const int k = static_cast<int>(grads.size());
    for (int64_t e = 0; e < n; ++e) {
      float acc = grads[0][f0 + e];
      for (int d = 1; d < k; ++d) acc += grads[static_cast<size_t>(d)][f0 + e];
      sum[e] = acc;
    }
  }

  // Device `me` of k: blocks [lo, hi) of the flat range.
  void run(int me) {
    const int k = static_cast<int>(grads.size());
    constexpr int64_t B = ops::kElementBlock;
    barrier.arrive_and_wait();  // every replica's backward has written its gradients
    const int64_t blocks = (total + B - 1) / B;
    const int64_t lo = blocks * me / k, hi = blocks * (me + 1) / k;
    const bool clipped = sgd.clip && !sgd.sum_rule;
    float factor = 1.0f;
    if (clipped) {
      parallel_for(hi - lo, [&](int64_t j) {
        const int64_t f0 = (lo + j) * B, n = std::min(total, f0 + B) - f0;
        sum_block(f0, n, grads[0] + f0);  // element by element, in place: each read first
        block_squares[static_cast<size_t>(lo + j)] = ops::cpu::sum_squares(n, grads[0] + f0);
      });
      barrier.arrive_and_wait();  // every block's sum and square sum are written
      double squares = 0.0;
      for (double s : block_squares) squares += s;
      factor = ops::clip_coefficient(static_cast<float>(squares), 1.0f / batch, sgd.max_norm);
    }
    parallel_for(hi - lo, [&](int64_t j) {
      const int64_t f0 = (lo + j) * B, n = std::min(total, f0 + B) - f0;
      if (clipped) {
        update_block(f0, n, grads[0] + f0, &factor);
        return;
      }
      float sum[B];
      sum_block(f0, n, sum);
      update_block(f0, n, sum, nullptr);
    });
    barrier.arrive_and_wait();  // every block of every replica is written before anyone reads
  }
};

// Enqueues the collective on every replica's device (see SharedUpdate).
void shared_update(const Model& m, std::vector<Replica>& replicas, const std::vector<Tensor>& grads,
                   const Sgd& sgd, int64_t batch) {
  const size_t k = replicas.size();
  auto sh = std::make_shared<SharedUpdate>(static_cast<int>(k));
  sh->sgd = sgd;
  sh->batch = static_cast<float>(batch);
  for (size_t i = 0; i < m.num_params(); ++i) {
    sh->order.push_back(i);
    // Checked here, before anything is enqueued, as adam_step checks.
    if (sgd.adam() && !sgd.sum_rule)
      sh->adam.push_back(ops::adam_body(sgd.kind == Sgd::Kind::AdamW ? "adamw" : "adam",
                                        adam_hyper(sgd, i), sh->batch));
  }
  std::sort(sh->order.begin(), sh->order.end(),
            [&m](size_t a, size_t b) { return m.offset(a) < m.offset(b); });
  for (size_t i : sh->order) {
    sh->offsets.push_back(m.offset(i));
    sh->ends.push_back(m.offset(i) + replicas[0].state.params[i].numel());
  }
  sh->total = m.flat_size();
  if (sgd.clip && !sgd.sum_rule)
    sh->block_squares.assign(
        static_cast<size_t>((sh->total + ops::kElementBlock - 1) / ops::kElementBlock), 0.0);
  for (size_t d = 0; d < k; ++d) {
    Replica& r = replicas[d];
    // As update(): the optimizer's state is made, zeroed, at the first step that needs it.
    const bool adam = sgd.adam() && !sgd.sum_rule;
    const bool with_buf = adam || (sgd.momentum != 0.0f && !sgd.sum_rule);
    if (with_buf) make_zeroed(m, r.momentum, r.device);
    if (adam) make_zeroed(m, r.second, r.device);
    if (adam && sgd.amsgrad) make_zeroed(m, r.max_second, r.device);
    sh->grads.push_back(grads[d].f32());
    std::vector<float*> ps;
    for (const Tensor& p : r.state.params) ps.push_back(p.f32());
    sh->params.push_back(std::move(ps));
    sh->momentum.push_back(with_buf ? r.momentum.f32() : nullptr);
    sh->second.push_back(adam ? r.second.f32() : nullptr);
    sh->max_second.push_back(adam && sgd.amsgrad ? r.max_second.f32() : nullptr);
  }
  // Every queue gets its part in the same host order (see comm::allreduce), and each task keeps
  // its own replica's tensors alive: the others' are kept by their tasks, which all leave the
  // collective together.
  std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
  for (size_t d = 0; d < k; ++d) {
    Replica& r = replicas[d];
    std::vector<Tensor> keep = r.state.params;
    keep.push_back(grads[d]);
    for (const Tensor* t : {&r.momentum, &r.second, &r.max_second})
      if (t->defined()) keep.push_back(*t);
    enqueue_on(r.device, sgd.adam() ? "allreduce and adam" : "allreduce and sgd",
               [sh, me = static_cast<int>(d)] {
      try {
        sh->run(me);
      } catch (...) {
        sh->barrier.abort();  // release the devices waiting for this one
        throw;
      }
    }, keep);
  }
}

// Batch norm's running statistics are those of the first replica's shard (rank 0's under mpirun),
// as with PyTorch's DataParallel, and every replica keeps a copy of them. (A synchronised layer's
// are the same on every replica already: each updates them from the same combined statistics.)
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
  if (b.grads.device() != a.grads.device())
    comm::count_collective(static_cast<int64_t>(b.grads.nbytes()));
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

// One device's work: shards [lo, hi) (a tree node), each computed whole on the replica from its
// rows in `inputs` (already on the replica's device) and summed pairwise in tree order. Only
// shard `stats` (a micro-batch's first) moves batch norm's running statistics (the replica's own
// buffers); other shards write a scratch copy that nobody reads. Dropout's masks take the step's
// seed and each shard's first row in the batch (rows[shard].first).
Partial local_sum(const Model& m, const std::vector<std::pair<Tensor, Tensor>>& inputs,
                  int64_t lo, int64_t hi, const Replica& r, const ReplicaState& scratch,
                  int64_t stats, const std::vector<ShardSpan>& rows, uint64_t seed) {
  if (hi - lo == 1) {
    const auto& [Xs, ys] = inputs[static_cast<size_t>(lo)];
    Partial p{{lo, hi}, Tensor::empty({m.flat_size()}, DType::F32, r.device), Tensor()};
    p.loss = model_loss_and_grads(m, Xs, ys, lo == stats ? r.state : scratch, p.grads,
                                  [](size_t) {}, seed, rows[static_cast<size_t>(lo)].first);
    return p;
  }
  const int64_t mid = tree_split(lo, hi);
  Partial a = local_sum(m, inputs, lo, mid, r, scratch, stats, rows, seed);
  add_into(a, local_sum(m, inputs, mid, hi, r, scratch, stats, rows, seed));
  return a;
}

// The step with `num_shards` logical shards (see train_step), in `accumulate` micro-batches of
// num_shards / accumulate shards run one after another: micro-batch k is shards [k S/K,
// (k + 1) S/K), which go to the devices of all ranks in contiguous runs; each device sums its
// runs' tree nodes and keeps them. Once every micro-batch has run, this process joins its
// devices' nodes up the tree, the ranks exchange their top nodes (broadcasts from each rank, a
// list every rank can compute) and every rank forms the root identically: the tree and its
// additions are those of one batch, so the bits do not depend on `accumulate` either.
std::vector<Tensor> sharded_sums(const Model& m, const Tensor& X, const Tensor& y,
                                 std::vector<Replica>& replicas, int64_t num_shards,
                                 int64_t accumulate, uint64_t seed) {
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
                                        k * per, rows, seed));
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

// Atomic steps: labels outside [0, classes) leave parameters, momentum and batch-norm statistics
// as they were. Labels in host memory that no queued task has touched (a NumPy array's copy, a
// data batch) are read here, before anything is enqueued; returns false for the others.
bool labels_checked_on_host(const char* op, const Tensor& y, int64_t classes) {
  if (!y.device().is_cpu() || y.storage()->queued()) return false;
  for (int64_t i = 0; i < y.numel(); ++i) {
    const int64_t label = y.dtype() == DType::I64 ? y.data<int64_t>()[i] : y.data<int32_t>()[i];
    MGPU_CHECK_INDEX(label >= 0 && label < classes, op, ": label ", label, " in row ", i,
                     " is out of range for ", classes, " classes; labels must be class indices "
                     "in [0, ", classes, ")");
  }
  return true;
}

// The others are guarded on the devices: each device checks the whole label vector
// (find_bad_label), the step keeps copies of the state it changes, and where the check found a
// bad label restore_if_flagged puts them back after the update; raise_if_flagged then raises the
// error at the next wait and leaves it on the step's loss. The host does not wait.
struct LabelGuard {
  std::vector<Tensor> labels, flags;              // per device: the labels there, the verdict
  std::vector<std::vector<Tensor>> state, saved;  // per device: what the step changes, copies
};

// The flag's row and its label, read on the host once the device has computed them.
std::pair<int32_t, int64_t> read_flag_now(const Tensor& flag, const Tensor& labels) {
  const Event done = record_event(flag.device());
  done.queue->wait_done_or_rethrow(done.seq);
  int32_t row = 0;
  int64_t label = 0;
  int32_t narrow = 0;
  const bool wide = labels.dtype() == DType::I64;
  if (flag.device().is_cpu()) {
    row = *flag.data<int32_t>();
    if (row != ops::cuda::kNoBadRow)
      label = wide ? labels.data<int64_t>()[row] : labels.data<int32_t>()[row];
    return {row, label};
  }
  const int index = flag.device().index;
  gpu::read_to_host(index, &row, flag.raw(), sizeof row);
  if (row == ops::cuda::kNoBadRow) return {row, 0};
  if (wide) gpu::read_to_host(index, &label, labels.data<int64_t>() + row, sizeof label);
  else gpu::read_to_host(index, &narrow, labels.data<int32_t>() + row, sizeof narrow);
  return {row, wide ? label : narrow};
}

// Enqueued before any of the step's work: the checks and the copies (batch norm's running
// statistics change in forward already).
LabelGuard start_guard(const char* op, int64_t classes, const Tensor& y,
                       const std::vector<Replica>& replicas, const Sgd& sgd) {
  LabelGuard g;
  bool first_momentum = false;
  for (const Replica& r : replicas) {
    g.labels.push_back(ops::to_device(y, r.device));
    g.flags.push_back(ops::find_bad_label(g.labels.back(), classes));
    const bool needs_momentum = !sgd.sum_rule && (sgd.momentum != 0.0f || sgd.adam());
    first_momentum = first_momentum || (needs_momentum && !r.momentum.defined()) ||
                     (sgd.adam() && !r.second.defined()) ||
                     (sgd.adam() && sgd.amsgrad && !r.max_second.defined());
  }
  // A first step with momentum creates the buffers, which a failed step must not leave behind:
  // this once, the host waits for the verdict.
  if (first_momentum) {
    auto [row, label] = read_flag_now(g.flags[0], g.labels[0]);
    MGPU_CHECK_INDEX(row == ops::cuda::kNoBadRow, op, ": label ", label, " in row ", row,
                     " is out of range for ", classes, " classes; labels must be class indices "
                     "in [0, ", classes, ")");
  }
  for (const Replica& r : replicas) {
    std::vector<Tensor> state = r.state.params, saved;
    state.insert(state.end(), r.state.buffers.begin(), r.state.buffers.end());
    if (r.momentum.defined()) state.push_back(r.momentum);
    if (r.second.defined()) state.push_back(r.second);
    if (r.max_second.defined()) state.push_back(r.max_second);
    for (const Tensor& t : state) saved.push_back(ops::to_device(t, r.device, true));
    g.state.push_back(std::move(state));
    g.saved.push_back(std::move(saved));
  }
  return g;
}

void finish_guard(const char* op, const LabelGuard& g, int64_t classes,
                  const std::vector<Tensor>& losses) {
  for (size_t d = 0; d < g.flags.size(); ++d) {
    for (size_t j = 0; j < g.state[d].size(); ++j)
      ops::restore_if_flagged(g.state[d][j], g.saved[d][j], g.flags[d]);
    ops::raise_if_flagged(op, g.flags[d], g.labels[d], classes, losses[d]);
  }
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

namespace {

std::atomic<int64_t> g_fail_after_bucket{-1};

void injected_failure(size_t bucket) {
  int64_t armed = static_cast<int64_t>(bucket);
  if (g_fail_after_bucket.load(std::memory_order_relaxed) != armed ||
      !g_fail_after_bucket.compare_exchange_strong(armed, -1))
    return;
  throw OutOfMemoryError(detail::cat("train_step: out of memory after bucket ", bucket,
                                     " of the all-reduce (injected for testing)"));
}

}  // namespace

void fail_next_step_after_bucket(int64_t bucket) {
  MGPU_CHECK_VALUE(bucket >= -1, "fail_next_step_after_bucket: bucket must be >= 0, or -1 for "
                   "none, got ", bucket);
  g_fail_after_bucket.store(bucket);
}

std::vector<Tensor> train_step(const Model& m, const Tensor& X, const Tensor& y,
                               std::vector<Replica>& replicas, const Sgd& sgd,
                               int64_t num_shards, const char* op, int64_t accumulate,
                               uint64_t seed) {
  trace::Span span("train_step");
  check_replicas(op, m, replicas);
  MGPU_CHECK_VALUE(X.dim() >= 1 && y.dim() == 1 && X.size(0) == y.size(0), op, ": X and "
                   "y must hold the same number of examples, got X ", X.shape(), " and y ",
                   y.shape());
  MGPU_CHECK_VALUE(X.size(0) > 0, op, ": the minibatch is empty");
  MGPU_CHECK_TYPE(y.dtype() == DType::I64 || y.dtype() == DType::I32, op, ": labels y must be "
                  "int32 or int64 class indices, got ", dtype_name(y.dtype()));
  MGPU_CHECK_VALUE(num_shards >= 0, op, ": the number of logical shards must be >= 1 "
                   "(or 0: one shard per device), got ", num_shards);
  MGPU_CHECK_VALUE(accumulate >= 1, op, ": accumulate must be >= 1 (the number of micro-batches "
                   "whose gradients one update sums), got ", accumulate);
  MGPU_CHECK_VALUE(num_shards == 0 || num_shards % accumulate == 0, op, ": accumulate=",
                   accumulate, " must divide the number of logical shards (", num_shards,
                   "): each micro-batch is a run of whole shards; use an accumulate that divides ",
                   num_shards, ", or a shard count that is a multiple of ", accumulate);
  const int64_t classes = m.classes();
  const bool guarded = classes > 0 && !labels_checked_on_host(op, y, classes);
  LabelGuard guard;
  if (guarded) guard = start_guard(op, classes, y, replicas, sgd);
  if (num_shards > 0) {
    std::vector<Tensor> losses = sharded_sums(m, X, y, replicas, num_shards, accumulate, seed);
    for (Replica& r : replicas) update(m, r, r.grads, sgd, X.size(0));
    share_buffers(replicas);
    if (guarded) finish_guard(op, guard, classes, losses);
    return losses;
  }
  const std::vector<Device> devices = devices_of(replicas);
  const size_t L = devices.size(), world = static_cast<size_t>(comm::dist::world_size());
  // Synchronised batch norm meets the other replicas inside forward and backward, which a
  // replica's captured graphs cannot: such steps run without graphs.
  const bool synced = m.has_sync() && L * world > 1;
  // Graphs want every shard non-empty (an empty one takes the plain path's zero gradients); an
  // accumulated step runs its micro-batches without them, and so does a model with dropout (a
  // replayed graph would repeat its first step's masks).
  const bool graphs = !synced && accumulate == 1 && !m.has_dropout() &&
                      graphs_enabled(devices) && X.size(0) >= static_cast<int64_t>(L * world);
  // CPU devices of this process (and no other rank): one collective after backward sums the
  // gradients and updates every replica (shared_update); otherwise buckets are reduced as
  // backward produces them and every replica updates itself.
  const bool shared = devices[0].is_cpu() && L > 1 && world == 1 && shared_update_enabled();
  std::optional<comm::BucketAllReduce> reduce;
  if (!shared) {
    std::vector<int64_t> sizes;
    for (const Bucket& b : m.buckets()) sizes.push_back(b.end - b.begin);
    reduce.emplace(devices, sizes, X.size(0) * 256 + static_cast<int64_t>(L));
  }
  // Micro-batch k of `accumulate` is rows micro[k] of X, split over the devices as a batch is;
  // its gradients land in `grads` (the replicas' own buffers) for the first micro-batch, in
  // `fresh` for the others, added into `grads` bucket by bucket. Only the last micro-batch's
  // buckets go to the all-reduce, so the micro-batches before it reduce nothing.
  const std::vector<ShardSpan> micro = shard_ranges(X.size(0), static_cast<size_t>(accumulate));
  std::vector<Tensor> losses, grads, fresh;
  int64_t k = 0;
  auto bucket_done = [&](size_t b, size_t d) {
    const Bucket& bucket = m.buckets()[b];
    if (k > 0)
      ops::binary_inplace(ops::BinaryOp::Add, grads[d].slice_rows(bucket.begin, bucket.end),
                          fresh[d].slice_rows(bucket.begin, bucket.end));
    if (!reduce || k + 1 < accumulate) return;
    reduce->ready(b, d, grads[d].slice_rows(bucket.begin, bucket.end));
    if (d + 1 == L) injected_failure(b);
  };
  if (graphs) {
    std::vector<Tensor> xs, ys;
    {
      trace::Label label([] { return std::string("split and copy batch"); });
      xs = rank_shards(X, devices, false);
      ys = rank_shards(y, devices, false);
    }
    std::vector<std::shared_ptr<CapturedStep>> loaded;
    for (size_t d = 0; d < L; ++d)
      loaded.push_back(load_captured_step(m, xs[d], ys[d], replicas[d].state, devices[d]));
    for (size_t d = 0; d < L; ++d) grads.push_back(captured_grads(*loaded[d]));
    losses = replay_captured_steps(loaded, devices, bucket_done);
  } else {
    std::vector<const ReplicaState*> states;
    for (Replica& r : replicas) {
      if (!r.grads.defined()) r.grads = Tensor::empty({m.flat_size()}, DType::F32, r.device);
      grads.push_back(r.grads);
      if (accumulate > 1) fresh.push_back(Tensor::empty({m.flat_size()}, DType::F32, r.device));
      states.push_back(&r.state);
    }
    for (k = 0; k < accumulate; ++k) {
      const Tensor Xk = accumulate == 1 ? X : X.slice_rows(micro[static_cast<size_t>(k)].first,
                                                             micro[static_cast<size_t>(k)].second);
      const Tensor yk = accumulate == 1 ? y : y.slice_rows(micro[static_cast<size_t>(k)].first,
                                                             micro[static_cast<size_t>(k)].second);
      std::vector<Tensor> xs, ys;
      {
        trace::Label label([] { return std::string("split and copy batch"); });
        xs = rank_shards(Xk, devices, true);
        ys = rank_shards(yk, devices, true);
      }
      // Dropout's masks: replica d's first row in X is micro-batch k's first row plus its
      // shard's (shard rank * L + d of rank_shards' split).
      StepRows rows{seed, {}};
      if (m.has_dropout()) {
        const std::vector<ShardSpan> split = shard_ranges(Xk.size(0), L * world);
        for (size_t d = 0; d < L; ++d)
          rows.first_row.push_back(micro[static_cast<size_t>(k)].first +
                                   split[static_cast<size_t>(comm::dist::rank()) * L + d].first);
      }
      SyncReplicas sync;
      if (synced) {
        // Replica d of rank k is slot k * L + d: the shard order of rank_shards.
        sync.slots = L * world;
        sync.rows = Xk.size(0);
        for (size_t d = 0; d < L; ++d)
          sync.slot.push_back(static_cast<size_t>(comm::dist::rank()) * L + d);
        sync.sum = [&devices, world](const std::vector<Tensor>& parts, int64_t tag) {
          // GPUs of one process: summed on their streams, with no host wait per layer.
          if (world == 1 && !devices[0].is_cpu()) {
            comm::stream_sum_gpu(parts, devices);
            return;
          }
          comm::BucketAllReduce exchange(devices, {parts[0].numel()}, -1 - tag);
          for (size_t d = 0; d < parts.size(); ++d) exchange.ready(0, d, parts[d]);
        };
      }
      std::vector<Tensor> part = replicas_loss_and_grads(m, xs, ys, states,
                                                         k == 0 ? grads : fresh, bucket_done,
                                                         sync, rows);
      if (k == 0) {
        losses = part;
      } else {
        for (size_t d = 0; d < L; ++d)
          ops::binary_inplace(ops::BinaryOp::Add, losses[d], part[d]);
      }
    }
  }
  {
    trace::Label label([] { return std::string("sgd update"); });
    if (shared) {
      comm::count_collective(m.flat_size() * static_cast<int64_t>(sizeof(float)));
      shared_update(m, replicas, grads, sgd, X.size(0));
    } else {
      for (size_t d = 0; d < L; ++d) update(m, replicas[d], grads[d], sgd, X.size(0));
    }
    share_buffers(replicas);
  }
  if (guarded) finish_guard(op, guard, classes, losses);
  return losses;
}

std::vector<Tensor> evaluate_step(const Model& m, const Tensor& X, const Tensor& y,
                                  const std::vector<Replica>& replicas) {
  trace::Span span("evaluate_step");
  trace::Label label([] { return std::string("evaluate"); });
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
    out.push_back(Replica{devices[d], ReplicaState{params[d], {}}, Tensor(), Tensor(), Tensor(),
                          Tensor()});
  }
  return out;
}

}  // namespace

std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr,
                                int64_t num_shards, int64_t accumulate) {
  std::vector<Replica> replicas = lenet_replicas("train_batch", params, devices);
  require_dtype("train_batch", "X", X, DType::F32);
  MGPU_CHECK_VALUE(X.dim() == 4, "train_batch: X must have 4 dims (N, 1, 28, 28), got shape ",
                   X.shape());
  Sgd sgd;
  sgd.lr = lr;
  sgd.sum_rule = true;
  return train_step(lenet_model(params[0]), X, y, replicas, sgd, num_shards, "train_batch",
                    accumulate);
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  std::vector<Replica> replicas = lenet_replicas("evaluate_accuracy", params, devices);
  return evaluate_step(lenet_model(params[0]), X, y, replicas);
}

}  // namespace mgpu::train
