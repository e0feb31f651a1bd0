// cpp/train/graph_capture.h -- on GPUs a replica's forward and backward run as CUDA graphs, one per
// gradient bucket: captured the first time a (model, device, shard shape, replica) is seen and
// replayed after, so a step's many kernels cost a few launches and each bucket's all-reduce can
// start as soon as its graph has run. MGPU_CUDA_GRAPH=0 turns it off; so does MGPU_CONV=cudnn.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "train/layers.h"

namespace mgpu::train {

struct CapturedStep;

// True when every device is a GPU and graphs are allowed.
bool graphs_enabled(const std::vector<Device>& devices);

// Captures the replica's graphs (the first time) and copies its shard into their input buffers.
// The step does this for every device before any device joins an all-reduce: a shard living on
// another GPU is copied by this device's queue once everything enqueued on that GPU has run,
// which must not include all-reduce parts waiting for this device.
std::shared_ptr<CapturedStep> load_captured_step(const Model& m, const Tensor& xs, const Tensor& ys,
                                                 const ReplicaState& r, Device dev);
// The flat gradient buffer the graphs write (model_loss_and_grads' `grads`).
const Tensor& captured_grads(const CapturedStep& g);
// Replays every replica's graphs (steps[d] on devs[d]) bucket by bucket: graph b on every
// device, then bucket_done(b, d) for every device, then graph b + 1, as the plain step calls it,
// so each device joins a bucket's all-reduce in the same host order relative to the others'
// work. Returns copies of each replica's summed loss.
std::vector<Tensor> replay_captured_steps(const std::vector<std::shared_ptr<CapturedStep>>& steps,
                                          const std::vector<Device>& devs,
                                          const std::function<void(size_t, size_t)>& bucket_done);

}  // namespace mgpu::train
