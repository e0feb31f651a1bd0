// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include "comm/allreduce_mpi.h"
#include "comm/bucket_allreduce.h"
#include "core/gpu.h"
#include "ops/argmax.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"
#include "train/graph_capture.h"
#include "train/lenet.h"
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
    first_momentum = first_momentum || (sgd.momentum != 0.0f && !r.momentum.defined());
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

std::vector<Tensor> train_step(const Model& m, const Tensor& X, const Tensor& y,
                               std::vector<Replica>& replicas, const Sgd& sgd, const char* op) {
  check_replicas(op, m, replicas);
  MGPU_CHECK_VALUE(X.dim() >= 1 && y.dim() == 1 && X.size(0) == y.size(0), op, ": X and "
                   "y must hold the same number of examples, got X ", X.shape(), " and y ",
                   y.shape());
  MGPU_CHECK_VALUE(X.size(0) > 0, op, ": the minibatch is empty");
  MGPU_CHECK_TYPE(y.dtype() == DType::I64 || y.dtype() == DType::I32, op, ": labels y must be "
                  "int32 or int64 class indices, got ", dtype_name(y.dtype()));
  const int64_t classes = m.classes();
  const bool guarded = classes > 0 && !labels_checked_on_host(op, y, classes);
  LabelGuard guard;
  if (guarded) guard = start_guard(op, classes, y, replicas, sgd);
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
  if (guarded) finish_guard(op, guard, classes, losses);
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
                                const std::vector<Device>& devices, float lr) {
  std::vector<Replica> replicas = lenet_replicas("train_batch", params, devices);
  require_dtype("train_batch", "X", X, DType::F32);
  MGPU_CHECK_VALUE(X.dim() == 4, "train_batch: X must have 4 dims (N, 1, 28, 28), got shape ",
                   X.shape());
  Sgd sgd;
  sgd.lr = lr;
  sgd.sum_rule = true;
  return train_step(lenet_model(params[0]), X, y, replicas, sgd, "train_batch");
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  std::vector<Replica> replicas = lenet_replicas("evaluate_accuracy", params, devices);
  return evaluate_step(lenet_model(params[0]), X, y, replicas);
}

}  // namespace mgpu::train
