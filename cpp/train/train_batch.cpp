// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include "comm/allreduce.h"
#include "comm/allreduce_mpi.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"
#include "train/lenet.h"
#include "train/split_batch.h"

namespace mgpu::train {
namespace {

void check_replicas(const char* op, const Tensor& X, const Tensor& y,
                    const std::vector<std::vector<Tensor>>& params,
                    const std::vector<Device>& devices) {
  MGPU_CHECK_VALUE(!devices.empty(), op, ": the list of devices is empty");
  MGPU_CHECK_VALUE(params.size() == devices.size(), op, ": got ", params.size(),
                   " parameter replicas for ", devices.size(), " devices; pass one replica per "
                   "device, e.g. [get_params(params, d) for d in devices]");
  MGPU_CHECK_VALUE(X.dim() >= 1 && y.dim() == 1 && X.size(0) == y.size(0), op,
                   ": X and y must hold the same number of examples, got X ", X.shape(),
                   " and y ", y.shape());
  for (size_t d = 0; d < devices.size(); ++d) {
    check_lenet_params(op, params[d]);
    MGPU_CHECK_VALUE(params[d][0].device() == devices[d], op, ": replica ", d, " lives on ",
                     params[d][0].device(), " but devices[", d, "] is ", devices[d]);
  }
}

// In a multi-process world (mgpu.distributed, W ranks of L devices each) X and y are the global
// batch, the same on every rank, and this rank takes shards rank*L .. rank*L+L-1 of its split over
// W*L devices: the shards of one process's split over W*L devices, so both compute one step.
std::vector<Tensor> rank_rows(const Tensor& x, const std::vector<Device>& devices) {
  const int world = comm::dist::world_size();
  if (world == 1) return split_rows(x, devices);
  const size_t L = devices.size();
  auto ranges = shard_ranges(x.size(0), L * static_cast<size_t>(world));
  std::vector<Tensor> shards;
  for (size_t d = 0; d < L; ++d) {
    auto [begin, end] = ranges[static_cast<size_t>(comm::dist::rank()) * L + d];
    shards.push_back(ops::to_device(x.slice_rows(begin, end), devices[d]));
  }
  return shards;
}

}  // namespace

std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr) {
  check_replicas("train_batch", X, y, params, devices);
  MGPU_CHECK_VALUE(X.size(0) > 0, "train_batch: the minibatch is empty");
  std::vector<Tensor> xs = rank_rows(X, devices), ys = rank_rows(y, devices);
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> losses;
  for (size_t d = 0; d < devices.size(); ++d) {
    LeNetStep step = lenet_loss_and_grads(xs[d], ys[d], params[d]);
    grads.push_back(std::move(step.grads));
    losses.push_back(step.loss_sum);
  }
  comm::allreduce(grads);
  if (comm::dist::world_size() > 1) {
    // Across processes: device 0 holds this process's sum; reduce it with the other ranks',
    // then hand the result to the other local devices. The tag lets ranks check the geometry.
    comm::dist::allreduce(grads[0], comm::dist::Op::TrainStep,
                          X.size(0) * 256 + static_cast<int64_t>(devices.size()));
    for (size_t d = 1; d < devices.size(); ++d)
      for (size_t i = 0; i < kLeNetParams; ++i) ops::copy(grads[d][i], grads[0][i]);
  }
  const float scale = lr / static_cast<float>(X.size(0));
  for (size_t d = 0; d < devices.size(); ++d)
    for (size_t i = 0; i < kLeNetParams; ++i) ops::sgd_update(params[d][i], grads[d][i], scale);
  return losses;
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  check_replicas("evaluate_accuracy", X, y, params, devices);
  std::vector<Tensor> xs = rank_rows(X, devices), ys = rank_rows(y, devices), counts;
  for (size_t d = 0; d < devices.size(); ++d) {
    if (xs[d].size(0) == 0) {
      counts.push_back(Tensor::empty({}, DType::F32, devices[d]));
      ops::fill(counts.back(), 0.0);
      continue;
    }
    counts.push_back(ops::correct_count(lenet_forward(xs[d], params[d]), ys[d]));
  }
  return counts;
}

}  // namespace mgpu::train
