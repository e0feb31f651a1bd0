// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL: the
// checks, the split, forward and backward on every replica (through captured graphs where they
// run), the bucketed all-reduce or the shared update, the optimizer; and evaluation's counts.
// The deterministic step's sums, the label guard and the update live in files of their own.
#include "train/train_batch.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "comm/allreduce_mpi.h"
#include "comm/bucket_allreduce.h"
#include "comm/collective_counts.h"
#include "comm/shared_update.h"
#include "comm/stream_sum.h"
#include "core/trace.h"
#include "ops/argmax.h"
#include "ops/elementwise.h"
#include "train/graph_capture.h"
#include "train/label_guard.h"
#include "train/optimizer_step.h"
#include "train/shard_tree.h"
#include "train/sharded_sums.h"
#include "train/split_batch.h"

namespace mgpu::train {
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

std::vector<Device> devices_of(const std::vector<Replica>& replicas) {
  std::vector<Device> out;
  for (const Replica& r : replicas) out.push_back(r.device);
  return out;
}

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
    std::vector<Tensor> losses = sharded_sums(m, X, y, replicas, num_shards, accumulate, seed,
                                              sgd.comm_dtype);
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
  const bool shared = devices[0].is_cpu() && L > 1 && world == 1 && comm::shared_update_enabled();
  std::optional<comm::BucketAllReduce> reduce;
  if (!shared) {
    std::vector<int64_t> sizes;
    for (const Bucket& b : m.buckets()) sizes.push_back(b.end - b.begin);
    reduce.emplace(devices, sizes, X.size(0) * 256 + static_cast<int64_t>(L), sgd.comm_dtype);
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
      comm::count_collective(m.flat_size() *
                             static_cast<int64_t>(dtype_size(sgd.comm_dtype)));
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

}  // namespace mgpu::train
