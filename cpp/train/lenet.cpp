// cpp/train/lenet.cpp -- LeNet's parameter checks, its forward through lenet_model(), and the
// chapter's fused step and evaluation on its parameter lists (train_step, evaluate_step).
#include "train/lenet.h"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "train/layers.h"
#include "train/model.h"
#include "train/train_batch.h"

namespace mgpu::train {

void check_lenet_params(const char* op, const std::vector<Tensor>& p) {
  MGPU_CHECK_VALUE(p.size() == 8, op, ": LeNet takes 8 parameter arrays [W1, b1, W2, "
                   "b2, W3, b3, W4, b4], got ", p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    MGPU_CHECK_VALUE(p[i].defined(), op, ": parameter ", i, " is None");
    require_dtype(op, "every parameter", p[i], DType::F32);
    MGPU_CHECK_VALUE(p[i].device() == p[0].device(), op, ": parameters are on ", p[0].device(),
                     " and ", p[i].device(), "; keep one device's copy together (get_params)");
  }
  const int64_t dims[] = {4, 1, 4, 1, 2, 1, 2, 1};
  for (size_t i = 0; i < p.size(); ++i)
    MGPU_CHECK_VALUE(p[i].dim() == dims[i], op, ": parameter ", i, " must have ", dims[i],
                     " dims, got shape ", p[i].shape());
  MGPU_CHECK_VALUE(p[1].size(0) == p[0].size(0) && p[3].size(0) == p[2].size(0) &&
                   p[5].size(0) == p[4].size(1) && p[7].size(0) == p[6].size(1) &&
                   p[6].size(0) == p[4].size(1) && p[2].size(1) == p[0].size(0),
                   op, ": parameter shapes do not fit together: ", p[0].shape(), " ", p[1].shape(),
                   " ", p[2].shape(), " ", p[3].shape(), " ", p[4].shape(), " ", p[5].shape(), " ",
                   p[6].shape(), " ", p[7].shape());
}

const Model& lenet_model(const std::vector<Tensor>& p, ops::Precision precision) {
  static std::mutex mutex;
  // By shapes, device kind (the Model picks the fused CPU kernels for CPU replicas) and
  // precision.
  static auto* cache =
      new std::map<std::tuple<std::vector<Shape>, bool, ops::Precision>,
                   std::unique_ptr<Model>>;  // never freed
  std::vector<Shape> shapes;
  for (const Tensor& t : p) shapes.push_back(t.shape());
  const bool on_cpu = p[0].device().is_cpu();
  std::lock_guard<std::mutex> lock(mutex);
  auto& m = (*cache)[{shapes, on_cpu, precision}];
  if (!m) {
    // bf16 = 1: the layers' products take bfloat16 operands (on CPU replicas the
    // conv2d_relu_pool records run their fused kernel on rounded operands: ops/bf16.h).
    const double bf16 = precision == ops::Precision::BF16 ? 1 : 0;
    std::vector<LayerSpec> spec = {
        {"conv2d_relu_pool", {}, {{"pool", 2}, {"bf16", bf16}}, {}, {}},
        {"conv2d_relu_pool", {}, {{"pool", 2}, {"bf16", bf16}}, {}, {}},
        {"flatten", {}, {}, {}, {}},
        {"linear", {}, {{"bf16", bf16}}, {}, {}},
        {"relu", {}, {}, {}, {}},
        {"linear", {}, {{"bf16", bf16}}, {}, {}},
    };
    m = std::make_unique<Model>(spec, shapes, std::vector<Shape>{}, ops::ConvAlgo::Auto, on_cpu);
  }
  return *m;
}

Tensor lenet_forward(const Tensor& X, const std::vector<Tensor>& params) {
  check_lenet_params("lenet", params);
  require_dtype("lenet", "X", X, DType::F32);
  require_same_device("lenet", {&X, &params[0]});
  MGPU_CHECK_VALUE(X.dim() == 4, "lenet: X must have 4 dims (N, 1, 28, 28), got shape ", X.shape());
  return model_forward(lenet_model(params), X, ReplicaState{params, {}}, false);
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
                                int64_t num_shards, int64_t accumulate,
                                ops::Precision precision) {
  std::vector<Replica> replicas = lenet_replicas("train_batch", params, devices);
  require_dtype("train_batch", "X", X, DType::F32);
  MGPU_CHECK_VALUE(X.dim() == 4, "train_batch: X must have 4 dims (N, 1, 28, 28), got shape ",
                   X.shape());
  Sgd sgd;
  sgd.lr = lr;
  sgd.sum_rule = true;
  return train_step(lenet_model(params[0], precision), X, y, replicas, sgd, num_shards,
                    "train_batch", accumulate);
}

std::vector<Tensor> evaluate_batch(const Tensor& X, const Tensor& y,
                                   const std::vector<std::vector<Tensor>>& params,
                                   const std::vector<Device>& devices) {
  std::vector<Replica> replicas = lenet_replicas("evaluate_accuracy", params, devices);
  return evaluate_step(lenet_model(params[0]), X, y, replicas);
}

}  // namespace mgpu::train
