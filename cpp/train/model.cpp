// cpp/train/model.cpp -- building a Model from its spec: options, slots, parameter layout, buckets.
#include "train/model.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace mgpu::train {
namespace {

// The first bucket closes early so communication starts soon after backward does; later ones are
// bigger so the per-collective cost stays small (PyTorch's DDP does the same with 1 and 25 MB).
constexpr int64_t kFirstBucketFloats = 64 * 1024;   // 256 KB
constexpr int64_t kBucketFloats = 1024 * 1024;      // 4 MB

}  // namespace

Model::Model(const std::vector<LayerSpec>& spec, const std::vector<Shape>& param_shapes,
             const std::vector<Shape>& buffer_shapes, ops::ConvAlgo conv_algo, bool on_cpu)
    : param_shapes_(param_shapes), buffer_shapes_(buffer_shapes) {
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id++;
  MGPU_CHECK_VALUE(!spec.empty(), "Model: the spec has no layers");
  MGPU_CHECK_VALUE(!param_shapes.empty(), "Model: the model has no parameters to train");
  const BuildContext ctx{conv_algo, on_cpu};
  std::vector<int> param_owner(param_shapes.size(), -1), buffer_owner(buffer_shapes.size(), -1);
  size_t next_param = 0, next_buffer = 0;
  for (size_t i = 0; i < spec.size(); ++i) {
    const LayerSpec& s = spec[i];
    Layer l;
    l.name = "layer " + std::to_string(i) + " (" + s.kind + ")";
    l.kind = find_layer_kind(s.kind);
    MGPU_CHECK_VALUE(l.kind, "Model: ", l.name, " is not a known layer; use one of ",
                     known_layer_kinds());
    for (const auto& [key, value] : s.options)
      MGPU_CHECK_VALUE(std::count(l.kind->options.begin(), l.kind->options.end(), key), l.name,
                       ": unknown option '", key, "'");
    l.out = static_cast<int>(i) + 1;
    if (s.inputs.empty()) l.in.push_back(static_cast<int>(i));
    for (int64_t slot : s.inputs) {
      MGPU_CHECK_VALUE(slot >= 0 && slot <= static_cast<int64_t>(i), l.name, ": input slot ", slot,
                       " is out of range; it may read slot 0 (the input) to ", i,
                       " (the previous layer's output)");
      l.in.push_back(static_cast<int>(slot));
    }
    MGPU_CHECK_VALUE(static_cast<int>(l.in.size()) == l.kind->inputs, l.name, " takes ",
                     l.kind->inputs, " input slot(s), got ", l.in.size());
    l.index = static_cast<uint32_t>(i);
    if (l.kind->configure) l.kind->configure(l, s.options, ctx);
    has_sync_ = has_sync_ || l.sync;
    has_dropout_ = has_dropout_ || l.kind == &dropout_layer;

    auto [np, nb] = l.kind->owns ? l.kind->owns(l) : std::pair<int, int>{0, 0};
    auto take = [&](const std::vector<int64_t>& given, int n, size_t* next, std::vector<int>* owner,
                    const char* what, std::vector<int>* out) {
      MGPU_CHECK_VALUE(given.empty() || static_cast<int>(given.size()) == n, l.name, " takes ", n,
                       " ", what, ", the spec names ", given.size());
      for (int j = 0; j < n; ++j) {
        const int64_t at = given.empty() ? static_cast<int64_t>((*next)++) : given[j];
        MGPU_CHECK_VALUE(at >= 0 && at < static_cast<int64_t>(owner->size()), l.name, ": ", what,
                         " index ", at, " is out of range; the model has ", owner->size(), " ",
                         what);
        MGPU_CHECK_VALUE((*owner)[static_cast<size_t>(at)] < 0, l.name, ": ", what, " ", at,
                         " is already used by layer ", (*owner)[static_cast<size_t>(at)],
                         "; shared ", what, " are not supported");
        (*owner)[static_cast<size_t>(at)] = static_cast<int>(i);
        out->push_back(static_cast<int>(at));
      }
    };
    take(s.params, np, &next_param, &param_owner, "parameters", &l.params);
    take(s.buffers, nb, &next_buffer, &buffer_owner, "buffers", &l.buffers);
    if (l.kind->check_shapes) l.kind->check_shapes(l, param_shapes, buffer_shapes);
    layers_.push_back(std::move(l));
  }
  for (size_t j = 0; j < param_owner.size(); ++j)
    MGPU_CHECK_VALUE(param_owner[j] >= 0, "Model: parameter ", j, " (shape ", param_shapes[j],
                     ") is used by no layer; pass exactly the parameters the layers use");
  for (size_t j = 0; j < buffer_owner.size(); ++j)
    MGPU_CHECK_VALUE(buffer_owner[j] >= 0, "Model: buffer ", j, " is used by no layer");

  // MGPU_FUSE_LAYERS=0 turns the fusion off (tests and benches compare both); on by default, for
  // CPU replicas (the fused layers' kernels are CPU kernels; GPUs run the layers as given).
  const char* fuse = std::getenv("MGPU_FUSE_LAYERS");
  if (on_cpu && (!fuse || std::strcmp(fuse, "0") != 0)) fuse_layers();

  const Layer& last = layers_.back();
  if (last.kind == &linear_layer)
    classes_ = param_shapes[static_cast<size_t>(last.params[0])][last.transpose ? 0 : 1];

  // Which slots need a gradient, and which forward must keep for backward.
  grad_needed_.assign(static_cast<size_t>(num_slots()), false);
  saved_.assign(static_cast<size_t>(num_slots()), false);
  for (const Layer& l : layers_) {
    if (l.kind == &absorbed_layer) continue;
    bool g = !l.params.empty();
    for (int s : l.in) g = g || grad_needed_[static_cast<size_t>(s)];
    grad_needed_[static_cast<size_t>(l.out)] = g;
    if (!g) continue;  // no backward
    switch (l.kind->keeps) {
      case Keeps::Inputs:
        for (int s : l.in) saved_[static_cast<size_t>(s)] = true;
        break;
      case Keeps::Output: saved_[static_cast<size_t>(l.out)] = true; break;
      case Keeps::FirstAndOutput:
        saved_[static_cast<size_t>(l.in[0])] = true;
        saved_[static_cast<size_t>(l.out)] = true;
        break;
      case Keeps::Nothing: break;
    }
  }

  // Flat layout in reverse forward order, cut into buckets at layer boundaries.
  offsets_.assign(param_shapes.size(), 0);
  Bucket b;
  for (int i = static_cast<int>(layers_.size()) - 1; i >= 0; --i) {
    const Layer& l = layers_[static_cast<size_t>(i)];
    if (l.params.empty()) continue;
    for (int p : l.params) {
      offsets_[static_cast<size_t>(p)] = flat_size_;
      flat_size_ += numel(param_shapes[static_cast<size_t>(p)]);
    }
    b.end = flat_size_;
    b.last_layer = i;
    const int64_t cap = buckets_.empty() ? kFirstBucketFloats : kBucketFloats;
    if (b.end - b.begin >= cap) {
      buckets_.push_back(b);
      b.begin = b.end;
    }
  }
  if (b.end > b.begin) buckets_.push_back(b);
}

void Model::fuse_layers() {
  // A layer whose work a fused layer after it took over: it reads, owns and exchanges nothing.
  auto absorb = [](Layer* l) {
    l->kind = &absorbed_layer;
    l->in.clear(), l->params.clear(), l->buffers.clear();
    l->sync = false;
  };
  // readers[s]: how many inputs, over all layers, name slot s (an add of a slot to itself: 2).
  std::vector<int> readers(static_cast<size_t>(num_slots()), 0);
  for (const Layer& l : layers_)
    for (int s : l.in) ++readers[static_cast<size_t>(s)];
  // The batch norm writing slot s, if s is a batch norm's output read only once.
  auto lone_bn = [&](int s) -> Layer* {
    if (s < 1 || readers[static_cast<size_t>(s)] != 1) return nullptr;
    Layer& p = layers_[static_cast<size_t>(s - 1)];
    return p.kind == &batch_norm_layer ? &p : nullptr;
  };
  for (Layer& r : layers_) {
    if (r.kind != &relu_layer) continue;
    const int s = r.in[0];
    if (Layer* bn = lone_bn(s)) {
      Layer f = *bn;
      f.kind = &batch_norm_relu_layer;
      f.out = r.out;
      absorb(bn);
      r = std::move(f);
      continue;
    }
    if (s < 1 || readers[static_cast<size_t>(s)] != 1) continue;
    Layer& add = layers_[static_cast<size_t>(s - 1)];
    if (add.kind != &add_layer) continue;
    for (int k = 0; k < 2; ++k) {
      Layer* bn = lone_bn(add.in[static_cast<size_t>(k)]);
      if (!bn) continue;
      Layer f = *bn;
      f.kind = &batch_norm_add_relu_layer;
      f.add_name = add.name;
      f.in = {bn->in[0], add.in[static_cast<size_t>(1 - k)]};
      f.out = r.out;
      absorb(bn);
      absorb(&add);
      r = std::move(f);
      break;
    }
  }
}

std::pair<int, int> Model::fused_counts() const {
  std::pair<int, int> n{0, 0};
  for (const Layer& l : layers_) {
    n.first += l.kind == &batch_norm_relu_layer;
    n.second += l.kind == &batch_norm_add_relu_layer;
  }
  return n;
}

std::vector<std::pair<std::string, std::string>> Model::fusions() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Layer& l : layers_)
    if (l.kind->kernels) out.emplace_back(l.name, l.kind->kernels(l));
  return out;
}

std::vector<std::pair<std::string, std::string>> Model::conv_algorithms() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Layer& l : layers_)
    if (l.kind->conv)
      out.emplace_back(l.name, (l.precision == ops::Precision::BF16 ? "bf16 " : "") +
                                   std::string(ops::conv_algo_name(l.conv_algo)));
  return out;
}

void Model::check_replica(const char* op, const std::vector<Tensor>& params,
                          const std::vector<Tensor>& buffers, Device device) const {
  MGPU_CHECK_VALUE(params.size() == param_shapes_.size(), op, ": the model takes ",
                   param_shapes_.size(), " parameters, got ", params.size());
  MGPU_CHECK_VALUE(buffers.size() == buffer_shapes_.size(), op, ": the model takes ",
                   buffer_shapes_.size(), " buffers, got ", buffers.size());
  auto check = [&](const Tensor& t, const Shape& want, const char* what, size_t j) {
    MGPU_CHECK_VALUE(t.defined(), op, ": ", what, " ", j, " is None");
    MGPU_CHECK_TYPE(t.dtype() == DType::F32, op, ": ", what, " ", j, " must be float32, got ",
                    describe(t));
    MGPU_CHECK_VALUE(t.shape() == want, op, ": ", what, " ", j, " has shape ", t.shape(),
                     " but the model was built for ", want);
    MGPU_CHECK_VALUE(t.device() == device, op, ": ", what, " ", j, " lives on ", t.device(),
                     " but its replica's device is ", device);
  };
  for (size_t j = 0; j < params.size(); ++j) check(params[j], param_shapes_[j], "parameter", j);
  for (size_t j = 0; j < buffers.size(); ++j) check(buffers[j], buffer_shapes_[j], "buffer", j);
}

}  // namespace mgpu::train
