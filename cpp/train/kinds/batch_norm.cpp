// cpp/train/kinds/batch_norm.cpp -- the batch norm layers: batch_norm, and the two the Model's
// fusion makes of it on CPU replicas, batch_norm_relu (y = relu(bn(x))) and batch_norm_add_relu
// (y = relu(bn(x) + shortcut), inputs x and the shortcut).
#include <tuple>

#include "ops/batch_norm.h"
#include "train/layer_kind.h"

namespace mgpu::train {
namespace {

void check_input(const Layer& l, const Tensor& x, const Tensor& running_mean) {
  MGPU_CHECK_VALUE(x.dim() == 4 || x.dim() == 2, l.name, ": expects (N, C, H, W) or (N, C), "
                   "got shape ", x.shape());
  MGPU_CHECK_VALUE(x.size(1) == running_mean.size(0), l.name, ": the input has ", x.size(1),
                   " channels but the layer normalises ", running_mean.size(0));
}

void check_shapes(const Layer& l, const Shapes& ps, const Shapes& bs) {
  const Shape& running_mean = bs[static_cast<size_t>(l.buffers[0])];
  MGPU_CHECK_VALUE(running_mean.size() == 1, l.name, ": running_mean must have shape (C,), got ",
                   running_mean);
  const int64_t c = running_mean[0];
  check_vector_shape(l, bs[static_cast<size_t>(l.buffers[1])], c, "running_var");
  for (size_t i = 0; i < l.params.size(); ++i)
    check_vector_shape(l, ps[static_cast<size_t>(l.params[i])], c, i ? "beta" : "gamma");
}

const Tensor* gamma_of(const LayerCall& c) { return c.l.bias ? &c.param(0) : nullptr; }
const Tensor* beta_of(const LayerCall& c) { return c.l.bias ? &c.param(1) : nullptr; }

// Training mode: the batch statistics of x, kept in s for backward and for the running
// statistics' update (a synchronised layer's came from the exchange).
void batch_stats(const Layer& l, const Tensor& x, Saved* s) {
  if (!s->synced) s->count = static_cast<double>(x.numel() / x.size(1));
  MGPU_CHECK_VALUE(s->count > 1, l.name, ": expected more than 1 value per channel when training, "
                   "got input of shape ", x.shape(), "; use a bigger batch per device");
  if (!s->synced) std::tie(s->a, s->b) = ops::batch_norm_stats(x);
}

Tensor bn_forward(const LayerCall& c, Saved* s) {
  const Tensor& x = c.in[0];
  const auto eps = static_cast<float>(c.l.eps);
  check_input(c.l, x, c.buffer(0));
  if (!c.training)
    return ops::batch_norm_forward(x, c.buffer(0), c.buffer(1), gamma_of(c), beta_of(c), eps);
  batch_stats(c.l, x, s);
  return ops::batch_norm_forward(x, s->a, s->b, gamma_of(c), beta_of(c), eps);
}

void bn_backward(const LayerCall& c, const Tensor&, const Tensor& dy, const Saved& s,
                 const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
                 std::vector<Tensor>* dp) {
  const Tensor& x = c.in[0];
  const auto eps = static_cast<float>(c.l.eps);
  if (!s.synced) {
    // The replica's own statistics: the sums and dx in one op (dx re-reads from cache).
    ops::BatchNormGrads g = ops::batch_norm_backward_full(x, nullptr, dy, s.a, s.b, gamma_of(c),
                                                          eps, need_dx[0], false);
    if (need_dx[0]) (*dx)[0] = g.dx;
    if (c.l.bias) *dp = {g.sum_dy_xhat, g.sum_dy};
    return;
  }
  // Synchronised: this replica's sums are dgamma, dbeta; dx sees the statistics' dependence on
  // every replica's x: the sums over all replicas.
  if (need_dx[0])
    (*dx)[0] = ops::batch_norm_backward(x, dy, s.a, s.b, gamma_of(c), s.all_dy, s.all_dy_xhat,
                                        s.count, eps, true);
  if (c.l.bias) *dp = {s.part_dy_xhat, s.part_dy};
}

// The fused layers: the shortcut (batch_norm_add_relu's second input) or nullptr.
const Tensor* shortcut_of(const LayerCall& c) {
  if (c.l.kind != &batch_norm_add_relu_layer) return nullptr;
  MGPU_CHECK_VALUE(c.in[0].shape() == c.in[1].shape(), c.l.add_name, ": adds the output of ",
                   c.l.name, " (shape ", c.in[0].shape(), ") and slot ", c.l.in[1], " (shape ",
                   c.in[1].shape(), "); they must be equal");
  return &c.in[1];
}

Tensor act_forward(const LayerCall& c, Saved* s) {
  const Tensor& x = c.in[0];
  check_input(c.l, x, c.buffer(0));
  const Tensor* shortcut = shortcut_of(c);
  const auto eps = static_cast<float>(c.l.eps);
  if (!c.training)
    return ops::batch_norm_act_forward(x, c.buffer(0), c.buffer(1), gamma_of(c), beta_of(c),
                                       shortcut, eps);
  batch_stats(c.l, x, s);
  return ops::batch_norm_act_forward(x, s->a, s->b, gamma_of(c), beta_of(c), shortcut, eps);
}

// The mask comes from the saved output y (out); dz = dy * mask exists only in registers.
void act_backward(const LayerCall& c, const Tensor& out, const Tensor& dy, const Saved& s,
                  const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
                  std::vector<Tensor>* dp) {
  const Tensor& x = c.in[0];
  const auto eps = static_cast<float>(c.l.eps);
  const bool want_sc = c.l.kind == &batch_norm_add_relu_layer && need_dx[1];
  if (!s.synced) {
    // The replica's own statistics: the sums and dx in one op (dx re-reads from cache).
    ops::BatchNormGrads g = ops::batch_norm_backward_full(x, &out, dy, s.a, s.b, gamma_of(c),
                                                          eps, need_dx[0], want_sc);
    if (need_dx[0]) (*dx)[0] = g.dx;
    if (want_sc) (*dx)[1] = g.dshortcut;
    if (c.l.bias) *dp = {g.sum_dy_xhat, g.sum_dy};
    return;
  }
  // Synchronised: as for batch_norm, with dz in place of dy.
  if (need_dx[0] || want_sc) {
    auto [g, dsc] = ops::batch_norm_act_backward(x, out, dy, s.a, s.b, gamma_of(c), s.all_dy,
                                                 s.all_dy_xhat, s.count, eps, want_sc);
    if (need_dx[0]) (*dx)[0] = g;
    if (want_sc) (*dx)[1] = dsc;
  }
  if (c.l.bias) *dp = {s.part_dy_xhat, s.part_dy};
}

// Moves the running statistics towards the batch ones in place, PyTorch's way (running var
// unbiased).
void update_running_stats(const LayerCall& c, const Saved& s) {
  const auto m = static_cast<float>(c.l.momentum);
  ops::batch_norm_update_running(c.buffer(0), s.a, 1.0f - m, m);
  ops::batch_norm_update_running(c.buffer(1), s.b, 1.0f - m,
                                 static_cast<float>(m * s.count / (s.count - 1)));
}

std::pair<Tensor, Tensor> local_stats(const LayerCall& c, double* count) {
  const Tensor& x = c.in[0];
  check_input(c.l, x, c.buffer(0));
  *count = static_cast<double>(x.numel() / x.size(1));
  return ops::batch_norm_stats(x);
}

// A fused layer's sums are over dz = dy masked by its output.
std::pair<Tensor, Tensor> local_sums(const LayerCall& c, const Tensor& out, const Tensor& dy,
                                     const Saved& s) {
  const auto eps = static_cast<float>(c.l.eps);
  if (c.l.kind == &batch_norm_layer)
    return ops::batch_norm_backward_reduce(c.in[0], dy, s.a, s.b, eps);
  return ops::batch_norm_act_backward_reduce(c.in[0], out, dy, s.a, s.b, eps);
}

// What the three records share: parameters, buffers, shapes, the running statistics, the
// synchronised exchange.
LayerDef batch_norm_family(const char* name, bool in_spec, int inputs) {
  LayerDef d;
  d.name = name;
  d.in_spec = in_spec;
  d.inputs = inputs;
  d.owns = [](const Layer& l) { return std::pair<int, int>{l.bias ? 2 : 0, 2}; };
  d.check_shapes = check_shapes;
  d.update_buffers = update_running_stats;
  d.sync_channels = [](const LayerCall& c) { return c.buffer(0).size(0); };
  d.sync_stats = local_stats;
  d.sync_sums = local_sums;
  return d;
}

// The fused layers: one pass forward and backward; what runs is the kind's name.
LayerDef batch_norm_act(const char* name, int inputs) {
  LayerDef d = batch_norm_family(name, false, inputs);
  d.keeps = Keeps::FirstAndOutput;
  d.forward = act_forward;
  d.backward = act_backward;
  d.kernels = [](const Layer& l) { return l.kind->name; };
  return d;
}

}  // namespace

const LayerDef batch_norm_layer = [] {
  LayerDef d = batch_norm_family("batch_norm", true, 1);
  d.options = {"eps", "momentum", "affine", "sync"};
  d.configure = [](Layer& l, const Options& o, const BuildContext&) {
    l.bias = flag_option(o, "affine", true);
    l.sync = flag_option(o, "sync", false);
    l.eps = number_option(o, "eps", l.eps);
    l.momentum = number_option(o, "momentum", l.momentum);
    MGPU_CHECK_VALUE(l.eps > 0 && l.momentum >= 0 && l.momentum <= 1, l.name, ": eps must be > 0 "
                     "and momentum in [0, 1], got eps ", l.eps, ", momentum ", l.momentum);
  };
  d.forward = bn_forward;
  d.backward = bn_backward;
  return d;
}();

// Made from batch_norm -> relu (fields copied from the batch norm layer).
const LayerDef batch_norm_relu_layer = batch_norm_act("batch_norm_relu", 1);

// Made from batch_norm -> add -> relu: inputs x and the add's other operand.
const LayerDef batch_norm_add_relu_layer = batch_norm_act("batch_norm_add_relu", 2);

}  // namespace mgpu::train
