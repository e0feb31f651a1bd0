// cpp/train/layer_kind.h -- a fused-step layer, and the one record (LayerDef) that says what a
// kind of layer is: its name and options in the spec, how it reads them, which parameters and
// buffers it owns and their shapes, what its backward re-reads, and its forward and backward
// through the ops. Each kind's record lives in cpp/train/kinds/ (related kinds share a file) and
// is named once, in MGPU_LAYER_KINDS below.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "ops/conv2d.h"
#include "ops/dropout.h"
#include "ops/precision.h"

namespace mgpu::train {

struct LayerDef;

// One layer as Python describes it (see Model in python/mgpu/_core.pyi for the format).
struct LayerSpec {
  std::string kind;                        // "conv2d", "batch_norm", "relu", "add", ...
  std::vector<int64_t> inputs;             // input slots; empty: the previous layer's output
  std::map<std::string, double> options;   // stride, padding, bias, kernel, transpose, eps, ...
  std::vector<int64_t> params, buffers;    // indices into the replica's lists; empty: the next ones
};

// A layer of a built Model. Its kind's configure fills the fields of its options; the others keep
// their defaults.
struct Layer {
  const LayerDef* kind = nullptr;
  std::string name;                        // "layer 3 (conv2d)", for messages (a fused layer:
                                           // its batch norm's)
  std::string add_name;                    // batch_norm_add_relu: the add's name, for messages
  std::vector<int> in;                     // input slots
  int out = 0;                             // output slot
  int64_t stride = 1, padding = 0;         // conv2d (and max_pool2d's padding)
  int64_t kh = 2, kw = 2, sh = 2, sw = 2;  // avg_pool2d, max_pool2d (the fused layer's pool: kh)
  bool bias = true, transpose = false;     // conv2d / linear: has a bias; linear: W is (out, in)
                                           // (batch_norm: affine, it has gamma and beta)
  double eps = 1e-5, momentum = 0.1;       // batch_norm
  bool sync = false;                       // batch_norm: statistics over every replica of a step
  double p = 0.5;                          // dropout: the probability of zeroing an element
  uint32_t index = 0;                      // the layer's index in the spec (dropout's mask stream)
  ops::ConvAlgo conv_algo = ops::ConvAlgo::Auto;  // conv layers: the CPU conv's algorithm, fixed
                                                  // as the Model is built
  ops::Precision precision = ops::Precision::F32;  // conv2d, conv2d_relu_pool, linear: option
                                                   // bf16 = 1 runs their products in bfloat16
  bool round_db = false;                   // linear in bf16: the bias gradient sums dy rounded
                                           // to bfloat16 (nn.Linear, PyTorch's F.linear under
                                           // autocast), not the float32 dy (the chapter's
                                           // mm(X, W) + b, whose add is float32)
  bool fused_kernel = false;               // conv2d_relu_pool: its one CPU kernel runs (CPU
                                           // replicas; bf16: where it takes the shape), else
                                           // conv2d, relu, avg_pool2d; fixed as the Model is built
  std::vector<int> params, buffers;        // weight first, then bias (batch_norm: gamma, beta;
                                           // buffers running_mean, running_var)
};

// A replica: the parameters and buffers (BN running statistics) on one device.
struct ReplicaState {
  std::vector<Tensor> params, buffers;
};

// What a layer's backward needs beyond its inputs, kept by its training forward: the fused conv
// layer's relu mask (or, unfused, the conv and relu outputs), max pooling's indices, batch norm's
// batch mean and variance (a, b) over count values per channel. A synchronised batch norm gets a,
// b and count (of every replica's examples) from the exchange before its forward, and before its
// backward this replica's sums (part_*) and every replica's (all_*).
struct Saved {
  Tensor a, b;
  int64_t h = 0, w = 0;  // max pooling: its input's height and width (a holds the indices)
  double count = 0.0;
  bool synced = false;
  Tensor part_dy, part_dy_xhat, all_dy, all_dy_xhat;
};

// One call of a layer on one replica.
struct LayerCall {
  const Layer& l;
  const std::vector<Tensor>& in;  // the input slots' values
  const ReplicaState& r;
  ops::DropoutKey key;            // dropout's masks of this call
  bool training = true;           // batch statistics, dropout's masks
  bool for_backward = false;      // keep in Saved what backward needs
  const Tensor& param(size_t i) const { return r.params[static_cast<size_t>(l.params[i])]; }
  const Tensor& buffer(size_t i) const { return r.buffers[static_cast<size_t>(l.buffers[i])]; }
};

// What, beyond the tensors in Saved, a layer's backward re-reads of its slots, so forward keeps
// them until backward (an eval forward keeps nothing).
enum class Keeps {
  Inputs,          // every input slot
  Output,          // its output (relu: x > 0 exactly where relu(x) > 0)
  FirstAndOutput,  // its first input and its output (batch norm + relu: x and the relu's mask)
  Nothing,         // nothing (add; max pooling keeps its indices, dropout recomputes its mask)
};

// What the Model's build knows when it reads a layer's options.
struct BuildContext {
  ops::ConvAlgo conv_algo = ops::ConvAlgo::Auto;  // every conv layer's CPU algorithm
  bool on_cpu = true;  // the replicas are CPU devices (the fused CPU kernels run)
};

using Options = std::map<std::string, double>;
using Shapes = std::vector<Shape>;

// A kind of layer. Records are constants built once; Layer::kind points at one.
struct LayerDef {
  std::string name;                   // its name in the spec ("conv2d"), or what a fused kind
                                      // runs ("batch_norm_relu")
  bool in_spec = true;                // a spec may name it (false: the Model's fusion makes it)
  int inputs = 1;                     // input slots
  std::vector<std::string> options;   // the option names a spec may give it
  // Reads (and checks) its options into the layer's fields.
  void (*configure)(Layer& l, const Options& o, const BuildContext& ctx) = nullptr;
  // How many parameters and buffers it owns (may depend on its options).
  std::pair<int, int> (*owns)(const Layer& l) = nullptr;
  // Checks the shapes of the parameters and buffers it was given (ValueError naming the layer).
  void (*check_shapes)(const Layer& l, const Shapes& params, const Shapes& buffers) = nullptr;
  Keeps keeps = Keeps::Inputs;
  // The output. A training forward with c.for_backward keeps in *s what backward needs.
  Tensor (*forward)(const LayerCall& c, Saved* s) = nullptr;
  // Given dy and the layer's output, writes the inputs' gradients ((*dx)[k], left undefined where
  // need_dx[k] is false) and the parameters' (*dp, in the layer's parameter order).
  void (*backward)(const LayerCall& c, const Tensor& out, const Tensor& dy, const Saved& s,
                   const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
                   std::vector<Tensor>* dp) = nullptr;
  // After a training forward of the whole model was enqueued without an error: moves the layer's
  // buffers (batch norm's running statistics). nullptr: it has none to move.
  void (*update_buffers)(const LayerCall& c, const Saved& s) = nullptr;
  // A synchronised layer (Layer::sync) across the replicas of a step: the channels it combines,
  // this replica's (count, mean, var) of x before its forward, and its (sum dy, sum dy * xhat)
  // before its backward.
  int64_t (*sync_channels)(const LayerCall& c) = nullptr;
  std::pair<Tensor, Tensor> (*sync_stats)(const LayerCall& c, double* count) = nullptr;
  std::pair<Tensor, Tensor> (*sync_sums)(const LayerCall& c, const Tensor& out, const Tensor& dy,
                                         const Saved& s) = nullptr;
  // What runs, for a layer whose kernels the build chose (Model::fusions); nullptr: the layer
  // runs its op as named.
  std::string (*kernels)(const Layer& l) = nullptr;
  bool conv = false;  // its CPU conv algorithm is fixed at build (Model::conv_algorithms)
};

// Every kind, by name: its record NAME_layer is defined in its kind's file of cpp/train/kinds/.
// A spec may name each kind whose record has in_spec; the Model's fusion makes batch_norm_relu
// and batch_norm_add_relu. A new kind: its record, and its name here.
#define MGPU_LAYER_KINDS(X)                                                                  \
  X(conv2d) X(conv2d_relu_pool) X(batch_norm) X(batch_norm_relu) X(batch_norm_add_relu)      \
  X(relu) X(dropout) X(add) X(flatten) X(avg_pool2d) X(max_pool2d) X(global_avg_pool)       \
  X(linear)
#define MGPU_DECLARE_LAYER_KIND(name) extern const LayerDef name##_layer;
MGPU_LAYER_KINDS(MGPU_DECLARE_LAYER_KIND)
#undef MGPU_DECLARE_LAYER_KIND
// The place of a layer merged into a fused one after it: it runs nothing, its slot stays empty.
extern const LayerDef absorbed_layer;

// The kinds a spec may name, in MGPU_LAYER_KINDS's order.
const std::vector<const LayerDef*>& spec_layer_kinds();
// The kind a spec names, or nullptr.
const LayerDef* find_layer_kind(const std::string& spec_name);
// The spec's kind names, for messages.
std::string known_layer_kinds();

// Option readers for configure: an integer >= min (ValueError naming the layer and option), a
// flag (nonzero), a number; each returns `fallback` when the option is absent.
int64_t int_option(const Layer& l, const Options& o, const std::string& key, int64_t fallback,
                   int64_t min);
bool flag_option(const Options& o, const std::string& key, bool fallback);
double number_option(const Options& o, const std::string& key, double fallback);
// Checks that `s` is the vector shape (n,) (ValueError naming the layer and `what`).
void check_vector_shape(const Layer& l, const Shape& s, int64_t n, const char* what);

}  // namespace mgpu::train
