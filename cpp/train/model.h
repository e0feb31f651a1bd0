// cpp/train/model.h -- a network as a program of layers over value slots, built from a spec.
// Slot 0 is the input X; layer i reads its input slots and writes slot i + 1; the last slot is the
// logits. A slot read by several layers (a residual shortcut) gets the sum of their gradients.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/conv2d.h"
#include "ops/precision.h"

namespace mgpu::train {

// BatchNormRelu (y = relu(bn(x))) and BatchNormAddRelu (y = relu(bn(x) + shortcut), inputs x and
// the shortcut) are made by Model's constructor from batch_norm -> relu and batch_norm -> add ->
// relu whose intermediate slots have no other reader; the fused layer takes the relu's place and
// output slot, the batch norm and add it replaced become Absorbed (they run nothing, their slots
// stay empty). MGPU_FUSE_LAYERS=0 (read when a Model is built) keeps the layers as given. Their
// kernels are CPU kernels: a Model built for GPUs keeps the layers as given too.
enum class LayerKind {
  Conv2d, Conv2dReluPool, BatchNorm, Relu, AvgPool2d, MaxPool2d, GlobalAvgPool, Flatten, Linear,
  Add, Dropout, BatchNormRelu, BatchNormAddRelu, Absorbed
};

// A batch norm, alone or fused with what follows it (owns gamma, beta and the running buffers).
inline bool is_batch_norm(LayerKind k) {
  return k == LayerKind::BatchNorm || k == LayerKind::BatchNormRelu ||
         k == LayerKind::BatchNormAddRelu;
}

// One layer as Python describes it (see Model in python/mgpu/_core.pyi for the format).
struct LayerSpec {
  std::string kind;                        // "conv2d", "batch_norm", "relu", "add", ...
  std::vector<int64_t> inputs;             // input slots; empty: the previous layer's output
  std::map<std::string, double> options;   // stride, padding, bias, kernel, transpose, eps, ...
  std::vector<int64_t> params, buffers;    // indices into the replica's lists; empty: the next ones
};

struct Layer {
  LayerKind kind;
  std::string name;                        // "layer 3 (conv2d)", for messages (a fused layer:
                                           // its batch norm's)
  std::string add_name;                    // BatchNormAddRelu: the add's name, for its messages
  std::vector<int> in;                     // input slots
  int out = 0;                             // output slot
  int64_t stride = 1, padding = 0;         // conv2d (and max_pool2d's padding)
  int64_t kh = 2, kw = 2, sh = 2, sw = 2;  // avg_pool2d, max_pool2d (the fused layer's pool: kh)
  bool bias = true, transpose = false;     // conv2d / linear: has a bias; linear: W is (out, in)
  double eps = 1e-5, momentum = 0.1;       // batch_norm
  bool sync = false;                       // batch_norm: statistics over every replica of a step
  double p = 0.5;                          // dropout: the probability of zeroing an element
  uint32_t index = 0;                      // the layer's index in the spec (dropout's mask stream)
  ops::ConvAlgo conv_algo = ops::ConvAlgo::Auto;  // conv2d (and conv2d_relu_pool's unfused
                                           // path): the CPU conv's algorithm, fixed as the Model
                                           // is built
  ops::Precision precision = ops::Precision::F32;  // conv2d, conv2d_relu_pool, linear: option
                                                   // bf16 = 1 runs their products in bfloat16
  bool fused_kernel = false;               // conv2d_relu_pool: its one CPU kernel runs (CPU
                                           // replicas, float32), else conv2d, relu, avg_pool2d;
                                           // fixed as the Model is built
  std::vector<int> params, buffers;        // weight first, then bias (batch_norm: gamma, beta;
                                           // buffers running_mean, running_var)
};

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

  // Merges batch_norm -> relu and batch_norm -> add -> relu (see LayerKind).
  void fuse_layers();
};

}  // namespace mgpu::train
