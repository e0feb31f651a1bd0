// cpp/train/train_batch.cpp -- the fused step: everything enqueued from one call, no GIL.
#include "train/train_batch.h"

#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "comm/allreduce.h"
#include "comm/allreduce_gpu.h"
#include "comm/allreduce_mpi.h"
#include "core/gpu.h"
#include "ops/argmax.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"
#include "ops/vendor_gpu.h"
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
    MGPU_CHECK_VALUE(devices[d].is_cpu() == devices[0].is_cpu(), op, ": devices ", devices[0],
                     " and ", devices[d], " mix CPU and GPU devices; train on one kind");
    check_lenet_params(op, params[d]);
    MGPU_CHECK_VALUE(params[d][0].device() == devices[d], op, ": replica ", d, " lives on ",
                     params[d][0].device(), " but devices[", d, "] is ", devices[d]);
  }
}

// In a multi-process world (mgpu.distributed, W ranks of L devices each) X and y are the global
// batch, the same on every rank, and this rank takes shards rank*L .. rank*L+L-1 of its split over
// W*L devices: the shards of one process's split over W*L devices, so both compute one step.
// The rows of x this rank's devices take, as views of x (wherever x lives).
std::vector<Tensor> rank_slices(const Tensor& x, size_t L) {
  const size_t world = static_cast<size_t>(comm::dist::world_size());
  auto ranges = shard_ranges(x.size(0), L * world);
  std::vector<Tensor> shards;
  for (size_t d = 0; d < L; ++d) {
    auto [begin, end] = ranges[static_cast<size_t>(comm::dist::rank()) * L + d];
    shards.push_back(x.slice_rows(begin, end));
  }
  return shards;
}

std::vector<Tensor> rank_rows(const Tensor& x, const std::vector<Device>& devices) {
  if (comm::dist::world_size() == 1) return split_rows(x, devices);
  std::vector<Tensor> shards = rank_slices(x, devices.size());
  for (size_t d = 0; d < devices.size(); ++d) shards[d] = ops::to_device(shards[d], devices[d]);
  return shards;
}

// ---- CUDA graphs: on GPUs the steady-state forward + backward of a replica is two graphs ---------
// Captured the first time a (device, shard shape, replica) is seen and replayed after: the step's
// ~40 kernels cost two launches. Graph A is forward, loss and the dense layers' backward; graph B
// the conv layers' backward, so the dense gradients' all-reduce (on the communication stream with
// NCCL) runs while B computes. Inputs are copied into the graphs' own buffers, the gradients land
// in their own buffers (reduced and applied right after, outside the graphs), and the loss is
// copied out, so nothing the caller keeps is overwritten by a later replay. MGPU_CUDA_GRAPH=0
// turns it off; it is off with MGPU_CONV=cudnn (cuDNN's workspace is allocated per call).
// Executed on emulated GPUs (single-stream capture and replay, cpp/cuda/emu); on real GPUs only compiled.

bool graphs_enabled(const std::vector<Device>& devices) {
  if (!MGPU_GPU_BUILD) return false;
  for (const Device& d : devices)
    if (d.is_cpu()) return false;
  const char* v = std::getenv("MGPU_CUDA_GRAPH");
  if (v && std::string(v) == "0") return false;
  return ops::conv_path() != ops::ConvPath::Cudnn;
}

struct CapturedStep {
  Tensor x, y;                               // the graphs' input buffers
  LeNetStep out;                             // their gradient and loss buffers
  std::shared_ptr<gpu::Graph> graph_a;       // set by the capturing tasks
  std::shared_ptr<gpu::Graph> graph_b;
  std::vector<Queue::DeferredCheck> checks;  // the label checks, re-armed at every replay
  std::shared_ptr<gpu::GraphPool> pool;      // the intermediates' memory
};

using StepKey = std::tuple<int, Shape, Shape, DType, std::vector<const void*>>;
constexpr size_t kMaxCapturedSteps = 16;

std::shared_ptr<CapturedStep> captured_step(const Tensor& xs, const Tensor& ys,
                                            const std::vector<Tensor>& params, Device dev) {
  static std::mutex mutex;
  static auto* cache = new std::map<StepKey, std::shared_ptr<CapturedStep>>;  // never destroyed
  static auto* order = new std::deque<StepKey>;
  std::vector<const void*> where;
  for (const Tensor& p : params) where.push_back(p.raw());
  StepKey key{dev.index, xs.shape(), ys.shape(), ys.dtype(), where};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;

  auto g = std::make_shared<CapturedStep>();
  g->x = Tensor::empty(xs.shape(), DType::F32, dev);
  g->y = Tensor::empty(ys.shape(), ys.dtype(), dev);
  Queue& q = queue_of(dev);
  const bool cublas = ops::gemm_path() == ops::GemmPath::Cublas;
  q.enqueue("train_batch (capturing a CUDA graph)", [dev, &q, cublas] {
#if MGPU_BUILT_CUDA && !MGPU_CUDA_EMULATION_BUILD
    // cublasCreate allocates device memory (cudaMalloc), which the capturing thread may not do:
    // make the handle before the capture, not at the first mm inside it.
    if (cublas) ops::cuda::cublas_handle(dev.index);
#endif
    (void)cublas;
    gpu::begin_capture(dev.index);
    q.begin_graph_checks();
  });
  gpu::begin_graph_pool(dev.index);
  auto end = [g, dev, &q] {
    g->checks = q.end_graph_checks();
    g->graph_b = gpu::end_capture(dev.index);
  };
  // Between the dense and the conv layers' backward: graph A ends, graph B begins.
  auto split = [g, dev, &q](const std::vector<Tensor>&) {
    q.enqueue("train_batch (capturing a CUDA graph)", [g, dev] {
      try {
        g->graph_a = gpu::end_capture(dev.index);
      } catch (...) {
        gpu::begin_capture(dev.index);  // B is still captured (and ended), so the state stays
        throw;                          // consistent; the step raises capture_failed() after
      }
      gpu::begin_capture(dev.index);
    });
  };
  try {
    g->out = lenet_loss_and_grads(g->x, g->y, params, split);
  } catch (...) {
    g->pool = gpu::end_graph_pool();
    q.enqueue("train_batch (capturing a CUDA graph)", end);
    throw;
  }
  g->pool = gpu::end_graph_pool();
  q.enqueue("train_batch (capturing a CUDA graph)", end);
  (*cache)[key] = g;
  order->push_back(key);
  if (order->size() > kMaxCapturedSteps) {
    cache->erase(order->front());
    order->pop_front();
  }
  return g;
}

[[noreturn]] void capture_failed() {
  throw DeviceError("the CUDA graphs of this step could not be captured (see the first error on "
                    "this device); set MGPU_CUDA_GRAPH=0 to run train_batch without graphs");
}

// Captures a replica's graphs (the first time) and copies its shard into their input buffers.
// train_batch does this for every device before any device joins an all-reduce: a shard living
// on another GPU (X on gpu(0)) is copied by this device's queue once *everything* enqueued on
// that GPU has run -- which must not include its all-reduce parts, since those wait at a barrier
// for this device's part, queued behind the copy.
std::shared_ptr<CapturedStep> load_graph_step(const Tensor& xs, const Tensor& ys,
                                              const std::vector<Tensor>& params, Device dev) {
  std::shared_ptr<CapturedStep> g = captured_step(xs, ys, params, dev);
  ops::copy(g->x, xs);
  ops::copy(g->y, ys);
  return g;
}

// One replica's forward + backward through its graphs; returns the gradients and the loss.
LeNetStep graph_step(const std::shared_ptr<CapturedStep>& g, Device dev,
                     const DenseGradsReady& dense_ready) {
  Queue& q = queue_of(dev);
  q.enqueue("train_batch (CUDA graph A)", [g, dev, &q] {
    if (!g->graph_a) capture_failed();
    gpu::launch(*g->graph_a, dev.index);
    // Every replay writes the same flag and label buffers: check copies of this replay's, so
    // a later replay cannot overwrite its verdict before the host waits.
    std::vector<Queue::DeferredCheck> mine;
    for (const Queue::DeferredCheck& c : g->checks) {
      const auto* labels = c.fn.target<ops::LabelCheck>();
      mine.push_back(labels ? Queue::DeferredCheck{c.name, c.seq, labels->snapshot()} : c);
    }
    q.defer_checks(mine);
  });
  const std::vector<Tensor>& grads = g->out.grads;
  if (dense_ready) dense_ready({grads[4], grads[5], grads[6], grads[7]});
  q.enqueue("train_batch (CUDA graph B)", [g, dev] {
    if (!g->graph_b) capture_failed();
    gpu::launch(*g->graph_b, dev.index);
  });
  LeNetStep out;
  out.grads = g->out.grads;
  out.loss_sum = ops::to_device(g->out.loss_sum, dev, /*force_copy=*/true);
  return out;
}

}  // namespace

std::vector<Tensor> train_batch(const Tensor& X, const Tensor& y,
                                const std::vector<std::vector<Tensor>>& params,
                                const std::vector<Device>& devices, float lr) {
  check_replicas("train_batch", X, y, params, devices);
  MGPU_CHECK_VALUE(X.size(0) > 0, "train_batch: the minibatch is empty");
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> losses;
  // Graphs want every shard non-empty (an empty one takes the plain path's zero gradients).
  const bool graphs = graphs_enabled(devices) &&
                      X.size(0) >= static_cast<int64_t>(devices.size()) * comm::dist::world_size();
  // Several GPUs reduce in two buckets: the dense layers' gradients as soon as each device's
  // backward has produced them (while it goes on with the conv layers), then the conv layers'.
  // CPU devices reduce one flat buffer after backward: their reduction runs on the same worker
  // threads as backward, so starting it early would gain nothing.
  const bool buckets = MGPU_GPU_BUILD && !devices[0].is_cpu() && devices.size() > 1;
#if MGPU_GPU_BUILD
  std::unique_ptr<comm::GpuAllReduce> dense_bucket, conv_bucket;
  if (buckets) {
    const std::vector<Tensor>& p = params[0];
    dense_bucket = std::make_unique<comm::GpuAllReduce>(
        devices, std::vector<Shape>{p[4].shape(), p[5].shape(), p[6].shape(), p[7].shape()},
        /*overlap=*/true);
    conv_bucket = std::make_unique<comm::GpuAllReduce>(
        devices, std::vector<Shape>{p[0].shape(), p[1].shape(), p[2].shape(), p[3].shape()},
        /*overlap=*/false, dense_bucket.get());
  }
#endif
  std::vector<Tensor> xs = graphs ? rank_slices(X, devices.size()) : rank_rows(X, devices);
  std::vector<Tensor> ys = graphs ? rank_slices(y, devices.size()) : rank_rows(y, devices);
  std::vector<std::shared_ptr<CapturedStep>> loaded;
  if (graphs)
    for (size_t d = 0; d < devices.size(); ++d)
      loaded.push_back(load_graph_step(xs[d], ys[d], params[d], devices[d]));
  for (size_t d = 0; d < devices.size(); ++d) {
    DenseGradsReady dense_ready;
#if MGPU_GPU_BUILD
    if (buckets)
      dense_ready = [&dense_bucket, d](const std::vector<Tensor>& g) { dense_bucket->join(d, g); };
#endif
    LeNetStep step = graphs ? graph_step(loaded[d], devices[d], dense_ready)
                            : lenet_loss_and_grads(xs[d], ys[d], params[d], dense_ready);
#if MGPU_GPU_BUILD
    if (buckets) conv_bucket->join(d, {step.grads[0], step.grads[1], step.grads[2], step.grads[3]});
#endif
    grads.push_back(std::move(step.grads));
    losses.push_back(step.loss_sum);
  }
  if (!buckets) comm::allreduce(grads);
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
