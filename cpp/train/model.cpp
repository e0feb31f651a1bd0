// cpp/train/model.cpp -- building a Model from its spec: options, slots, parameter layout, buckets.
#include "train/model.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

namespace mgpu::train {
namespace {

// The first bucket closes early so communication starts soon after backward does; later ones are
// bigger so the per-collective cost stays small (PyTorch's DDP does the same with 1 and 25 MB).
constexpr int64_t kFirstBucketFloats = 64 * 1024;   // 256 KB
constexpr int64_t kBucketFloats = 1024 * 1024;      // 4 MB

struct KindInfo {
  LayerKind kind;
  int inputs;                          // number of input slots
  std::set<std::string> options;       // the option names it accepts
};

const std::map<std::string, KindInfo>& kinds() {
  static const auto* table = new std::map<std::string, KindInfo>{
      {"conv2d", {LayerKind::Conv2d, 1, {"stride", "padding", "bias", "bf16"}}},
      {"conv2d_relu_pool", {LayerKind::Conv2dReluPool, 1, {"pool", "bf16"}}},
      {"batch_norm", {LayerKind::BatchNorm, 1, {"eps", "momentum", "affine", "sync"}}},
      {"relu", {LayerKind::Relu, 1, {}}},
      {"avg_pool2d", {LayerKind::AvgPool2d, 1, {"kernel", "stride"}}},
      {"max_pool2d", {LayerKind::MaxPool2d, 1, {"kernel", "stride", "padding"}}},
      {"global_avg_pool", {LayerKind::GlobalAvgPool, 1, {}}},
      {"flatten", {LayerKind::Flatten, 1, {}}},
      {"linear", {LayerKind::Linear, 1, {"bias", "transpose", "bf16"}}},
      {"add", {LayerKind::Add, 2, {}}},
      {"dropout", {LayerKind::Dropout, 1, {"p"}}},
  };
  return *table;
}

std::string known_kinds() {
  std::string s;
  for (const auto& [name, info] : kinds()) s += (s.empty() ? "" : ", ") + name;
  return s;
}

int64_t positive_int(const Layer& l, const std::map<std::string, double>& opts,
                     const std::string& key, int64_t fallback, int64_t min) {
  auto it = opts.find(key);
  if (it == opts.end()) return fallback;
  const double v = it->second;
  MGPU_CHECK_VALUE(v == static_cast<double>(static_cast<int64_t>(v)) && v >= min, l.name,
                   ": option ", key, " must be an integer >= ", min, ", got ", v);
  return static_cast<int64_t>(v);
}

bool flag(const std::map<std::string, double>& opts, const std::string& key, bool fallback) {
  auto it = opts.find(key);
  return it == opts.end() ? fallback : it->second != 0.0;
}

// How many parameters and buffers a layer owns.
std::pair<int, int> counts(const Layer& l) {
  switch (l.kind) {
    case LayerKind::Conv2d:
    case LayerKind::Linear: return {l.bias ? 2 : 1, 0};
    case LayerKind::Conv2dReluPool: return {2, 0};
    case LayerKind::BatchNorm: return {l.bias ? 2 : 0, 2};
    default: return {0, 0};
  }
}

void check_shapes(const Layer& l, const std::vector<Shape>& ps, const std::vector<Shape>& bs) {
  auto p = [&](size_t i) -> const Shape& { return ps[static_cast<size_t>(l.params[i])]; };
  auto vector_of = [&](const Shape& s, int64_t n, const char* what) {
    MGPU_CHECK_VALUE(s.size() == 1 && s[0] == n, l.name, ": ", what, " must have shape (", n,
                     ",), got ", s);
  };
  switch (l.kind) {
    case LayerKind::Conv2d:
    case LayerKind::Conv2dReluPool:
      MGPU_CHECK_VALUE(p(0).size() == 4, l.name, ": the weight must have 4 dims (K, C, R, S), "
                       "got shape ", p(0));
      if (l.params.size() > 1) vector_of(p(1), p(0)[0], "the bias");
      break;
    case LayerKind::Linear:
      MGPU_CHECK_VALUE(p(0).size() == 2, l.name, ": the weight must have 2 dims, got shape ",
                       p(0));
      if (l.params.size() > 1) vector_of(p(1), p(0)[l.transpose ? 0 : 1], "the bias");
      break;
    case LayerKind::BatchNorm: {
      MGPU_CHECK_VALUE(bs[static_cast<size_t>(l.buffers[0])].size() == 1, l.name,
                       ": running_mean must have shape (C,), got ",
                       bs[static_cast<size_t>(l.buffers[0])]);
      const int64_t c = bs[static_cast<size_t>(l.buffers[0])][0];
      vector_of(bs[static_cast<size_t>(l.buffers[1])], c, "running_var");
      for (size_t i = 0; i < l.params.size(); ++i) vector_of(p(i), c, i ? "beta" : "gamma");
      break;
    }
    default: break;
  }
}

}  // namespace

Model::Model(const std::vector<LayerSpec>& spec, const std::vector<Shape>& param_shapes,
             const std::vector<Shape>& buffer_shapes, ops::ConvAlgo conv_algo, bool on_cpu)
    : param_shapes_(param_shapes), buffer_shapes_(buffer_shapes) {
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id++;
  MGPU_CHECK_VALUE(!spec.empty(), "Model: the spec has no layers");
  MGPU_CHECK_VALUE(!param_shapes.empty(), "Model: the model has no parameters to train");
  std::vector<int> param_owner(param_shapes.size(), -1), buffer_owner(buffer_shapes.size(), -1);
  size_t next_param = 0, next_buffer = 0;
  for (size_t i = 0; i < spec.size(); ++i) {
    const LayerSpec& s = spec[i];
    Layer l;
    l.name = "layer " + std::to_string(i) + " (" + s.kind + ")";
    auto kind = kinds().find(s.kind);
    MGPU_CHECK_VALUE(kind != kinds().end(), "Model: ", l.name, " is not a known layer; use one of ",
                     known_kinds());
    l.kind = kind->second.kind;
    for (const auto& [key, value] : s.options)
      MGPU_CHECK_VALUE(kind->second.options.count(key), l.name, ": unknown option '", key, "'");
    l.out = static_cast<int>(i) + 1;
    if (s.inputs.empty()) l.in.push_back(static_cast<int>(i));
    for (int64_t slot : s.inputs) {
      MGPU_CHECK_VALUE(slot >= 0 && slot <= static_cast<int64_t>(i), l.name, ": input slot ", slot,
                       " is out of range; it may read slot 0 (the input) to ", i,
                       " (the previous layer's output)");
      l.in.push_back(static_cast<int>(slot));
    }
    MGPU_CHECK_VALUE(static_cast<int>(l.in.size()) == kind->second.inputs, l.name, " takes ",
                     kind->second.inputs, " input slot(s), got ", l.in.size());
    const auto& o = s.options;
    l.bias = flag(o, l.kind == LayerKind::BatchNorm ? "affine" : "bias", true);
    l.transpose = flag(o, "transpose", false);
    l.sync = flag(o, "sync", false);
    l.precision = flag(o, "bf16", false) ? ops::Precision::BF16 : ops::Precision::F32;
    if (l.kind == LayerKind::Conv2d || l.kind == LayerKind::Conv2dReluPool) l.conv_algo = conv_algo;
    has_sync_ = has_sync_ || l.sync;
    l.stride = positive_int(l, o, "stride", 1, 1);
    l.padding = positive_int(l, o, "padding", 0, 0);
    if (l.kind == LayerKind::AvgPool2d || l.kind == LayerKind::MaxPool2d) {
      MGPU_CHECK_VALUE(o.count("kernel"), l.name, ": give the pooling window as option 'kernel'");
      l.kh = l.kw = positive_int(l, o, "kernel", 2, 1);
      l.sh = l.sw = positive_int(l, o, "stride", l.kh, 1);
    }
    if (l.kind == LayerKind::Conv2dReluPool) {
      l.kh = l.kw = l.sh = l.sw = positive_int(l, o, "pool", 2, 1);
      l.fused_kernel = on_cpu && l.precision == ops::Precision::F32;  // its kernel's domain
    }
    l.index = static_cast<uint32_t>(i);
    if (o.count("p")) l.p = o.at("p");
    MGPU_CHECK_VALUE(l.p >= 0 && l.p <= 1, l.name, ": p must be a probability in [0, 1], got ",
                     l.p);
    has_dropout_ = has_dropout_ || l.kind == LayerKind::Dropout;
    if (o.count("eps")) l.eps = o.at("eps");
    if (o.count("momentum")) l.momentum = o.at("momentum");
    MGPU_CHECK_VALUE(l.eps > 0 && l.momentum >= 0 && l.momentum <= 1, l.name, ": eps must be > 0 "
                     "and momentum in [0, 1], got eps ", l.eps, ", momentum ", l.momentum);

    auto [np, nb] = counts(l);
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
    check_shapes(l, param_shapes, buffer_shapes);
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
  if (last.kind == LayerKind::Linear)
    classes_ = param_shapes[static_cast<size_t>(last.params[0])][last.transpose ? 0 : 1];

  // Which slots need a gradient, and which forward must keep for backward.
  grad_needed_.assign(static_cast<size_t>(num_slots()), false);
  saved_.assign(static_cast<size_t>(num_slots()), false);
  for (const Layer& l : layers_) {
    if (l.kind == LayerKind::Absorbed) continue;
    bool g = !l.params.empty();
    for (int s : l.in) g = g || grad_needed_[static_cast<size_t>(s)];
    grad_needed_[static_cast<size_t>(l.out)] = g;
    // Relu's backward reads its output (x > 0 exactly where relu(x) > 0), which the next layer
    // usually keeps anyway, so the batch norm or add output before it is freed in forward; add
    // reads nothing, dropout nothing (it recomputes its mask from the step's seed and rows), max
    // pooling only the indices its forward keeps; every other backward re-reads its input
    // (flatten and average pooling for its shape).
    if (!g || l.kind == LayerKind::Add || l.kind == LayerKind::MaxPool2d ||
        l.kind == LayerKind::Dropout)
      continue;
    // The fused layers re-read x (their batch norm's input) and their output y (the mask), not
    // the shortcut.
    if (l.kind == LayerKind::Relu) {
      saved_[static_cast<size_t>(l.out)] = true;
    } else if (l.kind == LayerKind::BatchNormRelu || l.kind == LayerKind::BatchNormAddRelu) {
      saved_[static_cast<size_t>(l.in[0])] = true;
      saved_[static_cast<size_t>(l.out)] = true;
    } else {
      for (int s : l.in) saved_[static_cast<size_t>(s)] = true;
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
  // readers[s]: how many inputs, over all layers, name slot s (an add of a slot to itself: 2).
  std::vector<int> readers(static_cast<size_t>(num_slots()), 0);
  for (const Layer& l : layers_)
    for (int s : l.in) ++readers[static_cast<size_t>(s)];
  // The batch norm writing slot s, if s is a batch norm's output read only once.
  auto lone_bn = [&](int s) -> Layer* {
    if (s < 1 || readers[static_cast<size_t>(s)] != 1) return nullptr;
    Layer& p = layers_[static_cast<size_t>(s - 1)];
    return p.kind == LayerKind::BatchNorm ? &p : nullptr;
  };
  for (Layer& r : layers_) {
    if (r.kind != LayerKind::Relu) continue;
    const int s = r.in[0];
    if (Layer* bn = lone_bn(s)) {
      Layer f = *bn;
      f.kind = LayerKind::BatchNormRelu;
      f.out = r.out;
      bn->kind = LayerKind::Absorbed;
      bn->in.clear(), bn->params.clear(), bn->buffers.clear();
      r = std::move(f);
      continue;
    }
    if (s < 1 || readers[static_cast<size_t>(s)] != 1) continue;
    Layer& add = layers_[static_cast<size_t>(s - 1)];
    if (add.kind != LayerKind::Add) continue;
    for (int k = 0; k < 2; ++k) {
      Layer* bn = lone_bn(add.in[static_cast<size_t>(k)]);
      if (!bn) continue;
      Layer f = *bn;
      f.kind = LayerKind::BatchNormAddRelu;
      f.add_name = add.name;
      f.in = {bn->in[0], add.in[static_cast<size_t>(1 - k)]};
      f.out = r.out;
      bn->kind = add.kind = LayerKind::Absorbed;
      bn->in.clear(), bn->params.clear(), bn->buffers.clear();
      add.in.clear();
      r = std::move(f);
      break;
    }
  }
}

std::pair<int, int> Model::fused_counts() const {
  std::pair<int, int> n{0, 0};
  for (const Layer& l : layers_) {
    n.first += l.kind == LayerKind::BatchNormRelu;
    n.second += l.kind == LayerKind::BatchNormAddRelu;
  }
  return n;
}

std::vector<std::pair<std::string, std::string>> Model::fusions() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Layer& l : layers_) {
    if (l.kind == LayerKind::Conv2dReluPool)
      out.emplace_back(l.name, l.fused_kernel ? "conv2d_relu_pool" : "conv2d, relu, avg_pool2d");
    else if (l.kind == LayerKind::BatchNormRelu)
      out.emplace_back(l.name, "batch_norm_relu");
    else if (l.kind == LayerKind::BatchNormAddRelu)
      out.emplace_back(l.name, "batch_norm_add_relu");
  }
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
