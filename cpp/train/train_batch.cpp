// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include "comm/allreduce.h"
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

}  // namespace

std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr) {
  check_replicas("train_batch", X, y, params, devices);
  MGPU_CHECK_VALUE(X.size(0) > 0, "train_batch: the minibatch is empty");
  std::vector<Tensor> xs = split_rows(X, devices), ys = split_rows(y, devices);
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> losses;
  for (size_t d = 0; d < devices.size(); ++d) {
    LeNetStep step = lenet_loss_and_grads(xs[d], ys[d], params[d]);
    grads.push_back(std::move(step.grads));
    losses.push_back(step.loss_sum);
  }
  comm::allreduce(grads);
  const float scale = lr / static_cast<float>(X.size(0));
  for (size_t d = 0; d < devices.size(); ++d)
    for (size_t i = 0; i < kLeNetParams; ++i) ops::sgd_update(params[d][i], grads[d][i], scale);
  return losses;
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  check_replicas("evaluate_accuracy", X, y, params, devices);
  std::vector<Tensor> xs = split_rows(X, devices), ys = split_rows(y, devices), counts;
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
