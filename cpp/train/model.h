// cpp/train/model.h -- a network as a program of layers over value slots, built from a spec.
// Slot 0 is the input X; layer i reads its input slots and writes slot i + 1; the last slot is the
// logits. A slot read by several layers (a residual shortcut) gets the sum of their gradients.
// What each kind of layer is and does: its record (train/layer_kind.h).
//
// On CPU replicas the Model's fusion merges batch_norm -> relu into batch_norm_relu and
// batch_norm -> add -> relu into batch_norm_add_relu where the intermediate slots have no other
// reader; the fused layer takes the relu's place and output slot, the batch norm and add it
// replaced become absorbed (they run nothing, their slots stay empty). MGPU_FUSE_LAYERS=0 (read
// when a Model is built) keeps the layers as given. The fused layers' kernels are CPU kernels: a
// Model built for GPUs keeps the layers as given too.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "ops/conv2d.h"
#include "train/layer_kind.h"

namespace mgpu::train {

// A contiguous range of the flat gradient buffer, reduced as one piece as soon as the backward of
// `last_layer` (the earliest layer, in forward order, owning a parameter in it) has run.
struct Bucket {
  int64_t begin = 0, end = 0;
  int last_layer = 0;
};

class Model {
 public:
  // Checks the spec against the parameter and buffer shapes (ValueError naming the layer).
  // conv_algo: what every conv layer runs on a CPU (ops::conv_algo_for(device) as the Model is
  // built: MGPU_CONV_ALGO is read once here, not at every conv call). on_cpu: the replicas are
  // CPU devices, so the fused CPU kernels run (conv2d_relu_pool's, batch norm + relu's); here,
  // and nowhere else, each layer's fused-or-unfused is decided (see fusions()).
  Model(const std::vector<LayerSpec>& spec, const std::vector<Shape>& param_shapes,
        const std::vector<Shape>& buffer_shapes, ops::ConvAlgo conv_algo = ops::ConvAlgo::Auto,
        bool on_cpu = true);

  // A number no other Model of this process has (keys the captured CUDA graphs).
  uint64_t id() const { return id_; }
  const std::vector<Layer>& layers() const { return layers_; }
  int num_slots() const { return static_cast<int>(layers_.size()) + 1; }
  size_t num_params() const { return param_shapes_.size(); }
  size_t num_buffers() const { return buffer_shapes_.size(); }
  // Parameter i's gradient lives at flat elements [offset(i), offset(i) + numel): parameters are
  // laid out in reverse forward order so that every bucket is one contiguous range.
  int64_t offset(size_t param) const { return offsets_[param]; }
  int64_t flat_size() const { return flat_size_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // How many batch norm layers were fused with their relu (and add): (BatchNormRelu,
  // BatchNormAddRelu) counts; (0, 0) with MGPU_FUSE_LAYERS=0.
  std::pair<int, int> fused_counts() const;
  // (layer name, what runs) for every layer whose kernels the build chose: conv2d_relu_pool
  // layers ("conv2d_relu_pool" fused, or "conv2d, relu, avg_pool2d") and the merged batch norm
  // layers ("batch_norm_relu", "batch_norm_add_relu").
  std::vector<std::pair<std::string, std::string>> fusions() const;
  // (layer name, algorithm) for each conv layer: the CPU conv algorithm fixed at build, prefixed
  // "bf16 " for a layer built with precision bf16.
  std::vector<std::pair<std::string, std::string>> conv_algorithms() const;
  // Some batch norm layer synchronises its statistics across replicas.
  bool has_sync() const { return has_sync_; }
  // Some layer is a dropout one (its masks need the step's seed and each replica's rows).
  bool has_dropout() const { return has_dropout_; }
  // The logits' width when the last layer is a linear one (the classes labels index), else 0.
  int64_t classes() const { return classes_; }
  // grad_needed(s): slot s depends on a parameter, so backward computes d(loss)/d(slot s).
  bool grad_needed(int slot) const { return grad_needed_[static_cast<size_t>(slot)]; }
  // saved(s): some layer's backward re-reads slot s (an input, or relu's output), so forward
  // keeps it until backward.
  bool saved(int slot) const { return saved_[static_cast<size_t>(slot)]; }

  // Checks one replica: the parameter and buffer counts, shapes, float32, all on `device`.
  void check_replica(const char* op, const std::vector<Tensor>& params,
                     const std::vector<Tensor>& buffers, Device device) const;

 private:
  uint64_t id_;
  std::vector<Layer> layers_;
  std::vector<Shape> param_shapes_, buffer_shapes_;
  std::vector<int64_t> offsets_;
  int64_t flat_size_ = 0;
  std::vector<Bucket> buckets_;
  int64_t classes_ = 0;
  std::vector<bool> grad_needed_, saved_;
  bool has_sync_ = false, has_dropout_ = false;

  // Merges batch_norm -> relu and batch_norm -> add -> relu (see the file's comment).
  void fuse_layers();
};

}  // namespace mgpu::train
