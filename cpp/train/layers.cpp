// cpp/train/layers.cpp -- each layer's forward and backward through the ops, and the walk of a
// Model's program: slots forward, gradients backward (summed where a slot fans out).
#include "train/layers.h"

#include <string>
#include <tuple>

#include "core/trace.h"
#include "ops/avg_pool2d.h"
#include "ops/batch_norm.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/max_pool2d.h"
#include "ops/relu.h"
#include "ops/softmax_ce.h"

namespace mgpu::train {
namespace {

// Whether the fused kernel takes these shapes. A layer built with it (Layer::fused_kernel: CPU
// replicas, float32) runs it when they fit; for shapes that do not, it runs conv2d, relu and
// avg_pool2d, whose checks then report the problem.
bool fused_fits(const Tensor& x, const Tensor& w, int64_t pool) {
  if (x.dim() != 4 || x.size(1) != w.size(1)) return false;
  const int64_t p = x.size(2) - w.size(2) + 1, q = x.size(3) - w.size(3) + 1;
  return p >= pool && q >= pool;
}

// What a layer's backward needs beyond its inputs: the fused layer's relu mask (or, unfused, the
// conv and relu outputs), max pooling's indices, batch norm's batch mean and variance (a, b) over
// count values per channel. A synchronised batch norm gets a, b and count (of every replica's
// examples) from the exchange before its forward, and before its backward this replica's sums
// (part_*) and every replica's (all_*).
struct Saved {
  Tensor a, b;
  int64_t h = 0, w = 0;  // max pooling: its input's height and width (a holds the indices)
  double count = 0.0;
  bool synced = false;
  Tensor part_dy, part_dy_xhat, all_dy, all_dy_xhat;
};

void check_bn_input(const Layer& l, const Tensor& x, const Tensor& running_mean) {
  MGPU_CHECK_VALUE(x.dim() == 4 || x.dim() == 2, l.name, ": expects (N, C, H, W) or (N, C), "
                   "got shape ", x.shape());
  MGPU_CHECK_VALUE(x.size(1) == running_mean.size(0), l.name, ": the input has ", x.size(1),
                   " channels but the layer normalises ", running_mean.size(0));
}

// Batch norm in training mode: normalise with the batch statistics (kept in s for backward and
// for the running statistics' update, which update_running_stats makes once the whole forward
// has been enqueued without an error).
Tensor batch_norm_train(const Layer& l, const Tensor& x, const Tensor* gamma, const Tensor* beta,
                        Saved* s) {
  if (!s->synced) s->count = static_cast<double>(x.numel() / x.size(1));
  MGPU_CHECK_VALUE(s->count > 1, l.name, ": expected more than 1 value per channel when training, "
                   "got input of shape ", x.shape(), "; use a bigger batch per device");
  if (!s->synced) std::tie(s->a, s->b) = ops::batch_norm_stats(x);
  return ops::batch_norm_forward(x, s->a, s->b, gamma, beta, static_cast<float>(l.eps));
}

// Moves the running statistics towards the batch ones in place, PyTorch's way (running var
// unbiased).
void update_running_stats(const Layer& l, const ReplicaState& r, const Saved& s) {
  const Tensor& running_mean = r.buffers[static_cast<size_t>(l.buffers[0])];
  const Tensor& running_var = r.buffers[static_cast<size_t>(l.buffers[1])];
  const auto m = static_cast<float>(l.momentum);
  ops::batch_norm_update_running(running_mean, s.a, 1.0f - m, m);
  ops::batch_norm_update_running(running_var, s.b, 1.0f - m,
                                 static_cast<float>(m * s.count / (s.count - 1)));
}

Tensor forward(const Layer& l, const std::vector<Tensor>& in, const ReplicaState& r,
               bool training, bool for_backward, Saved* s, const ops::DropoutKey& key) {
  auto p = [&](size_t i) -> const Tensor& { return r.params[static_cast<size_t>(l.params[i])]; };
  const Tensor& x = in[0];
  switch (l.kind) {
    case LayerKind::Conv2d:
      return ops::conv2d_forward(x, p(0), l.bias ? p(1) : Tensor(), l.stride, l.padding,
                                 l.conv_algo, l.precision);
    case LayerKind::Conv2dReluPool: {
      // The Model chose the kernel (GPUs and bf16: the conv alone, then relu and the pool).
      if (l.fused_kernel && fused_fits(x, p(0), l.kh)) {
        ops::Conv2dReluPool f = ops::conv2d_relu_pool_forward(x, p(0), p(1), 1, 0, l.kh,
                                                              for_backward);
        s->a = f.mask;
        return f.pooled;
      }
      s->a = ops::conv2d_forward(x, p(0), p(1), 1, 0, l.conv_algo, l.precision);
      s->b = ops::relu_forward(s->a);
      return ops::avg_pool2d_forward(s->b, l.kh, l.kh, l.kh, l.kh);
    }
    case LayerKind::BatchNorm: {
      const Tensor* gamma = l.bias ? &p(0) : nullptr;
      const Tensor* beta = l.bias ? &p(1) : nullptr;
      const Tensor& rm = r.buffers[static_cast<size_t>(l.buffers[0])];
      const Tensor& rv = r.buffers[static_cast<size_t>(l.buffers[1])];
      check_bn_input(l, x, rm);
      if (training) return batch_norm_train(l, x, gamma, beta, s);
      return ops::batch_norm_forward(x, rm, rv, gamma, beta, static_cast<float>(l.eps));
    }
    case LayerKind::BatchNormRelu:
    case LayerKind::BatchNormAddRelu: {
      const Tensor* gamma = l.bias ? &p(0) : nullptr;
      const Tensor* beta = l.bias ? &p(1) : nullptr;
      const Tensor& rm = r.buffers[static_cast<size_t>(l.buffers[0])];
      const Tensor& rv = r.buffers[static_cast<size_t>(l.buffers[1])];
      check_bn_input(l, x, rm);
      const Tensor* shortcut = nullptr;
      if (l.kind == LayerKind::BatchNormAddRelu) {
        MGPU_CHECK_VALUE(in[0].shape() == in[1].shape(), l.add_name, ": adds the output of ",
                         l.name, " (shape ", in[0].shape(), ") and slot ", l.in[1], " (shape ",
                         in[1].shape(), "); they must be equal");
        shortcut = &in[1];
      }
      const auto eps = static_cast<float>(l.eps);
      if (!training) return ops::batch_norm_act_forward(x, rm, rv, gamma, beta, shortcut, eps);
      if (!s->synced) s->count = static_cast<double>(x.numel() / x.size(1));
      MGPU_CHECK_VALUE(s->count > 1, l.name, ": expected more than 1 value per channel when "
                       "training, got input of shape ", x.shape(), "; use a bigger batch per "
                       "device");
      if (!s->synced) std::tie(s->a, s->b) = ops::batch_norm_stats(x);
      return ops::batch_norm_act_forward(x, s->a, s->b, gamma, beta, shortcut, eps);
    }
    case LayerKind::Absorbed: return Tensor();
    case LayerKind::Relu: return ops::relu_forward(x);
    case LayerKind::Dropout: return training ? ops::dropout_forward(x, key) : x;
    case LayerKind::AvgPool2d: return ops::avg_pool2d_forward(x, l.kh, l.kw, l.sh, l.sw);
    case LayerKind::MaxPool2d: {
      MGPU_CHECK_VALUE(x.dim() == 4, l.name, ": expects (N, C, H, W), got shape ", x.shape());
      ops::MaxPool2d f = ops::max_pool2d_forward(x, l.kh, l.kw, l.sh, l.sw, l.padding, l.padding,
                                                 for_backward);
      s->a = f.indices;
      s->h = x.size(2), s->w = x.size(3);
      return f.y;
    }
    case LayerKind::GlobalAvgPool:
      MGPU_CHECK_VALUE(x.dim() == 4, l.name, ": expects (N, C, H, W), got shape ", x.shape());
      return ops::avg_pool2d_forward(x, x.size(2), x.size(3), x.size(2), x.size(3));
    case LayerKind::Flatten:
      MGPU_CHECK_VALUE(x.dim() >= 1, l.name, ": cannot flatten a 0-d tensor");
      return x.reshape({x.size(0), -1});
    case LayerKind::Linear: {
      MGPU_CHECK_VALUE(x.dim() == 2, l.name, ": expects (N, features), got shape ", x.shape(),
                       "; put a flatten layer before it");
      const int64_t fan_in = p(0).size(l.transpose ? 1 : 0);
      MGPU_CHECK_VALUE(x.size(1) == fan_in, l.name, ": the input has ", x.size(1),
                       " features but the weight ", p(0).shape(), " expects ", fan_in);
      Tensor z = ops::mm(x, p(0), false, l.transpose, l.precision);
      return l.bias ? ops::binary(ops::BinaryOp::Add, z, p(1)) : z;
    }
    case LayerKind::Add:
      MGPU_CHECK_VALUE(in[0].shape() == in[1].shape(), l.name, ": adds slots ", l.in[0], " and ",
                       l.in[1], " of shapes ", in[0].shape(), " and ", in[1].shape(),
                       "; they must be equal");
      return ops::binary(ops::BinaryOp::Add, in[0], in[1]);
  }
  MGPU_ASSERT(false, "unknown layer kind");
  return {};
}

// Given dy (and the layer's output, which relu's backward reads), writes the inputs' gradients (dx[k], left undefined where need_dx[k] is false) and
// the parameters' (dp, in the layer's parameter order).
void backward(const Layer& l, const std::vector<Tensor>& in, const Tensor& out, const Tensor& dy,
              const ReplicaState& r, const Saved& s, const ops::DropoutKey& key,
              const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
              std::vector<Tensor>* dp) {
  auto p = [&](size_t i) -> const Tensor& { return r.params[static_cast<size_t>(l.params[i])]; };
  const Tensor& x = in[0];
  Tensor& dx0 = (*dx)[0];
  switch (l.kind) {
    case LayerKind::Conv2d: {
      ops::Conv2dGrads g =
          ops::conv2d_backward(x, p(0), dy, l.stride, l.padding, need_dx[0], l.bias, l.conv_algo,
                               l.precision);
      dx0 = g.dx;
      *dp = l.bias ? std::vector<Tensor>{g.dw, g.db} : std::vector<Tensor>{g.dw};
      return;
    }
    case LayerKind::Conv2dReluPool: {
      ops::Conv2dGrads g;
      if (!s.b.defined()) {
        g = ops::conv2d_relu_pool_backward(x, p(0), s.a, dy, 1, 0, l.kh, need_dx[0]);
      } else {
        Tensor da = ops::avg_pool2d_backward(s.b, dy, l.kh, l.kh, l.kh, l.kh);
        Tensor dc = ops::relu_backward(s.a, da);
        g = ops::conv2d_backward(x, p(0), dc, 1, 0, need_dx[0], true, l.conv_algo, l.precision);
      }
      dx0 = g.dx;
      *dp = {g.dw, g.db};
      return;
    }
    case LayerKind::BatchNorm: {
      const auto eps = static_cast<float>(l.eps);
      if (!s.synced) {
        // The replica's own statistics: the sums and dx in one op (dx re-reads from cache).
        ops::BatchNormGrads g = ops::batch_norm_backward_full(
            x, nullptr, dy, s.a, s.b, l.bias ? &p(0) : nullptr, eps, need_dx[0], false);
        if (need_dx[0]) dx0 = g.dx;
        if (l.bias) *dp = {g.sum_dy_xhat, g.sum_dy};
        return;
      }
      // Synchronised: this replica's sums are dgamma, dbeta; dx sees the statistics' dependence
      // on every replica's x: the sums over all replicas.
      if (need_dx[0])
        dx0 = ops::batch_norm_backward(x, dy, s.a, s.b, l.bias ? &p(0) : nullptr, s.all_dy,
                                       s.all_dy_xhat, s.count, eps, true);
      if (l.bias) *dp = {s.part_dy_xhat, s.part_dy};
      return;
    }
    case LayerKind::BatchNormRelu:
    case LayerKind::BatchNormAddRelu: {
      // The mask comes from the saved output y (out); dz = dy * mask exists only in registers.
      const auto eps = static_cast<float>(l.eps);
      const bool synced = s.synced;
      const bool add = l.kind == LayerKind::BatchNormAddRelu;
      const bool want_sc = add && need_dx[1];
      if (!synced) {
        // The replica's own statistics: the sums and dx in one op (dx re-reads from cache).
        ops::BatchNormGrads g = ops::batch_norm_backward_full(
            x, &out, dy, s.a, s.b, l.bias ? &p(0) : nullptr, eps, need_dx[0], want_sc);
        if (need_dx[0]) dx0 = g.dx;
        if (want_sc) (*dx)[1] = g.dshortcut;
        if (l.bias) *dp = {g.sum_dy_xhat, g.sum_dy};
        return;
      }
      // Synchronised: as for BatchNorm, with dz in place of dy.
      if (need_dx[0] || want_sc) {
        auto [g, dsc] = ops::batch_norm_act_backward(x, out, dy, s.a, s.b,
                                                     l.bias ? &p(0) : nullptr, s.all_dy,
                                                     s.all_dy_xhat, s.count, eps, want_sc);
        if (need_dx[0]) dx0 = g;
        if (want_sc) (*dx)[1] = dsc;
      }
      if (l.bias) *dp = {s.part_dy_xhat, s.part_dy};
      return;
    }
    case LayerKind::Absorbed: return;
    // relu(x) > 0 exactly where x > 0 (NaN stays NaN), so the output gives the input's mask.
    case LayerKind::Relu: dx0 = ops::relu_backward(out, dy); return;
    // The forward's mask, recomputed from the same counters (nothing was kept).
    case LayerKind::Dropout: dx0 = ops::dropout_backward(dy, key); return;
    case LayerKind::AvgPool2d:
      dx0 = ops::avg_pool2d_backward(x, dy, l.kh, l.kw, l.sh, l.sw);
      return;
    case LayerKind::MaxPool2d:
      dx0 = ops::max_pool2d_backward(s.a, dy, s.h, s.w, l.kh, l.kw, l.sh, l.sw, l.padding,
                                     l.padding);
      return;
    case LayerKind::GlobalAvgPool:
      dx0 = ops::avg_pool2d_backward(x, dy, x.size(2), x.size(3), x.size(2), x.size(3));
      return;
    case LayerKind::Flatten: dx0 = dy.reshape(x.shape()); return;
    case LayerKind::Linear: {
      // y = x W (+ b) with W (in, out), or y = x W^T (+ b) with W (out, in) when transposed.
      const ops::Precision pr = l.precision;
      Tensor dW = l.transpose ? ops::mm(dy, x, true, false, pr) : ops::mm(x, dy, true, false, pr);
      if (need_dx[0]) dx0 = ops::mm(dy, p(0), false, !l.transpose, pr);
      *dp = {dW};
      if (l.bias) dp->insert(dp->begin() + 1, ops::sum_to_shape(dy, p(1).shape()));
      return;
    }
    case LayerKind::Add:
      // Both operands get dy itself: nothing reads or writes it in place after this.
      (*dx)[0] = dy;
      (*dx)[1] = dy;
      return;
  }
}

// The view of parameter p's gradient in the flat buffer.
Tensor grad_view(const Model& m, const Tensor& grads, const ReplicaState& r, size_t p) {
  const int64_t at = m.offset(p), n = r.params[p].numel();
  return grads.slice_rows(at, at + n).reshape(r.params[p].shape());
}

struct Trace {
  std::vector<Tensor> slots;
  std::vector<Saved> saved;
  uint64_t seed = 0;        // dropout's: the step's seed and the first example's row in the
  int64_t first_row = 0;    // step's batch
};

// Dropout layer l's masks in this trace.
ops::DropoutKey dropout_key(const Layer& l, const Trace& t) {
  return ops::DropoutKey{t.seed, l.index, t.first_row, l.p};
}

// The last forward reader of each slot, so slots backward does not need are released early.
std::vector<int> last_uses(const Model& m) {
  std::vector<int> last_use(static_cast<size_t>(m.num_slots()), -1);
  for (size_t i = 0; i < m.layers().size(); ++i)
    for (int s : m.layers()[i].in) last_use[static_cast<size_t>(s)] = static_cast<int>(i);
  return last_use;
}

Trace start_trace(const Model& m, const Tensor& X) {
  require_dtype("Model", "X", X, DType::F32);
  Trace t;
  t.slots.resize(static_cast<size_t>(m.num_slots()));
  t.saved.resize(m.layers().size());
  t.slots[0] = X;
  return t;
}

void forward_layer(const Model& m, size_t i, Trace& t, const ReplicaState& r, bool training,
                   bool for_backward, const std::vector<int>& last_use) {
  const Layer& l = m.layers()[i];
  if (l.kind == LayerKind::Absorbed) return;  // its work runs in the fused layer after it
  std::vector<Tensor> in;
  for (int s : l.in) in.push_back(t.slots[static_cast<size_t>(s)]);
  try {
    trace::Label label([&] { return l.name + (training ? " forward" : " forward (eval)"); });
    t.slots[static_cast<size_t>(l.out)] = forward(l, in, r, training, for_backward, &t.saved[i],
                                                  dropout_key(l, t));
  } catch (const ValueError& e) {
    // An op's message about its shapes, prefixed with the layer that called it.
    if (std::string(e.what()).rfind(l.name, 0) == 0) throw;
    throw ValueError(l.name + ": " + e.what());
  }
  for (int s : l.in)
    if (last_use[static_cast<size_t>(s)] == static_cast<int>(i) && !(for_backward && m.saved(s)))
      t.slots[static_cast<size_t>(s)] = Tensor();
}

void update_all_running_stats(const Model& m, const Trace& t, const ReplicaState& r) {
  for (size_t i = 0; i < m.layers().size(); ++i)
    if (is_batch_norm(m.layers()[i].kind))
      update_running_stats(m.layers()[i], r, t.saved[i]);
}

// One replica's step in progress.
struct Pass {
  Tensor X, y, grads, loss;
  const ReplicaState* r = nullptr;
  bool empty = false;
  Trace t;
  std::vector<Tensor> dslot;
};

void backward_layer(const Model& m, size_t i, Pass& p) {
  const Layer& l = m.layers()[i];
  if (l.kind == LayerKind::Absorbed) return;
  Trace& t = p.t;
  Tensor dy = std::move(p.dslot[static_cast<size_t>(l.out)]);
  // The output leaves the trace now (every later reader's backward has run) and goes when this
  // backward is enqueued.
  const Tensor out = std::move(t.slots[static_cast<size_t>(l.out)]);
  t.slots[static_cast<size_t>(l.out)] = Tensor();
  trace::Label label([&] { return l.name + " backward"; });
  if (!dy.defined()) {
    // The layer does not reach the loss: its parameters' gradients are zero.
    for (int q : l.params) ops::fill(grad_view(m, p.grads, *p.r, static_cast<size_t>(q)), 0.0);
    return;
  }
  std::vector<Tensor> in, dx(l.in.size()), dp;
  std::vector<bool> need_dx;
  for (int s : l.in) {
    in.push_back(t.slots[static_cast<size_t>(s)]);
    need_dx.push_back(m.grad_needed(s));
  }
  backward(l, in, out, dy, *p.r, t.saved[i], dropout_key(l, t), need_dx, &dx, &dp);
  t.saved[i] = Saved();
  for (size_t k = 0; k < l.in.size(); ++k) {
    if (!need_dx[k] || !dx[k].defined()) continue;
    Tensor& acc = p.dslot[static_cast<size_t>(l.in[k])];
    // A slot read by several layers gets the sum of their gradients.
    acc = acc.defined() ? ops::binary(ops::BinaryOp::Add, acc, dx[k]) : dx[k];
  }
  for (size_t j = 0; j < dp.size(); ++j) {
    const size_t q = static_cast<size_t>(l.params[j]);
    ops::copy(grad_view(m, p.grads, *p.r, q), dp[j]);
  }
}

// reaches[s]: backward computes d(loss)/d(slot s) -- the same on every replica and rank, so all
// of them know which synchronised layers exchange sums in backward.
std::vector<bool> reaches_loss(const Model& m) {
  std::vector<bool> reaches(static_cast<size_t>(m.num_slots()), false);
  reaches.back() = true;
  for (int i = static_cast<int>(m.layers().size()) - 1; i >= 0; --i) {
    const Layer& l = m.layers()[static_cast<size_t>(i)];
    if (!reaches[static_cast<size_t>(l.out)]) continue;
    for (int s : l.in)
      if (m.grad_needed(s)) reaches[static_cast<size_t>(s)] = true;
  }
  return reaches;
}

// Each replica's zero-padded row of the step's parts: its own row `row` (width w) gets `fill`,
// every other row zeros, so summing the buffers over the replicas gathers every row exactly.
Tensor padded_row(Device device, size_t slots, size_t row, int64_t w,
                  const std::function<void(const Tensor&)>& fill) {
  Tensor parts = Tensor::empty({static_cast<int64_t>(slots) * w}, DType::F32, device);
  ops::fill(parts, 0.0);
  const int64_t at = static_cast<int64_t>(row) * w;
  if (fill) fill(parts.slice_rows(at, at + w));
  return parts;
}

// Forward of a synchronised batch norm: every replica's (count, mean, var) gathered, combined into
// the statistics of all examples, kept in each replica's Saved for the layer's forward and backward.
void exchange_stats(const Model& m, size_t i, std::vector<Pass>& ps, const SyncReplicas& sync) {
  const Layer& l = m.layers()[i];
  const size_t in = static_cast<size_t>(l.in[0]);
  std::vector<Tensor> parts;
  double local = 0.0;  // values per channel in one example, from a local x
  for (Pass& p : ps) {
    const Tensor& rm = p.r->buffers[static_cast<size_t>(l.buffers[0])];
    const int64_t C = rm.size(0);
    const int64_t w = 1 + 2 * C;
    const Device dev = rm.device();
    if (p.empty) {
      parts.push_back(padded_row(dev, sync.slots, 0, w, nullptr));
      continue;
    }
    const Tensor& x = p.t.slots[in];
    check_bn_input(l, x, rm);
    local = static_cast<double>(x.numel() / x.size(1)) / static_cast<double>(x.size(0));
    auto [mean, var] = ops::batch_norm_stats(x);
    const double n = static_cast<double>(x.numel() / x.size(1));
    parts.push_back(padded_row(dev, sync.slots, sync.slot[&p - ps.data()], w,
                               [&](const Tensor& row) {
      ops::fill(row.slice_rows(0, 1), n);
      ops::copy(row.slice_rows(1, 1 + C), mean);
      ops::copy(row.slice_rows(1 + C, w), var);
    }));
  }
  sync.sum(parts, 2 * static_cast<int64_t>(i));
  const double count = local * static_cast<double>(sync.rows);
  for (size_t d = 0; d < ps.size(); ++d) {
    if (ps[d].empty) continue;
    Saved& s = ps[d].t.saved[i];
    std::tie(s.a, s.b) = ops::batch_norm_combine_stats(
        parts[d].reshape({static_cast<int64_t>(sync.slots), -1}));
    s.count = count;
    s.synced = true;
  }
}

// Backward of a synchronised batch norm: every replica's (sum_dy, sum_dy_xhat) gathered and added.
void exchange_sums(const Model& m, size_t i, std::vector<Pass>& ps, const SyncReplicas& sync) {
  const Layer& l = m.layers()[i];
  std::vector<Tensor> parts;
  for (Pass& p : ps) {
    const Tensor& rm = p.r->buffers[static_cast<size_t>(l.buffers[0])];
    const int64_t C = rm.size(0);
    if (p.empty) {
      parts.push_back(padded_row(rm.device(), sync.slots, 0, 2 * C, nullptr));
      continue;
    }
    Saved& s = p.t.saved[i];
    const Tensor& x = p.t.slots[static_cast<size_t>(l.in[0])];
    const Tensor& dy = p.dslot[static_cast<size_t>(l.out)];
    MGPU_ASSERT(dy.defined(), l.name, ": no gradient reached a synchronised batch norm");
    // A fused layer's sums are over dz = dy masked by its saved output.
    std::tie(s.part_dy, s.part_dy_xhat) =
        l.kind == LayerKind::BatchNorm
            ? ops::batch_norm_backward_reduce(x, dy, s.a, s.b, static_cast<float>(l.eps))
            : ops::batch_norm_act_backward_reduce(x, p.t.slots[static_cast<size_t>(l.out)], dy,
                                                  s.a, s.b, static_cast<float>(l.eps));
    parts.push_back(padded_row(rm.device(), sync.slots, sync.slot[&p - ps.data()], 2 * C,
                               [&](const Tensor& row) {
      ops::copy(row.slice_rows(0, C), s.part_dy);
      ops::copy(row.slice_rows(C, 2 * C), s.part_dy_xhat);
    }));
  }
  sync.sum(parts, 2 * static_cast<int64_t>(i) + 1);
  for (size_t d = 0; d < ps.size(); ++d) {
    if (ps[d].empty) continue;
    Saved& s = ps[d].t.saved[i];
    std::tie(s.all_dy, s.all_dy_xhat) = ops::batch_norm_combine_sums(
        parts[d].reshape({static_cast<int64_t>(sync.slots), -1}));
  }
}

}  // namespace

Tensor model_forward(const Model& m, const Tensor& X, const ReplicaState& r, bool training) {
  Trace t = start_trace(m, X);
  const std::vector<int> last_use = last_uses(m);
  for (size_t i = 0; i < m.layers().size(); ++i) forward_layer(m, i, t, r, training, false, last_use);
  if (training) update_all_running_stats(m, t, r);
  return t.slots.back();
}

std::vector<Tensor> replicas_loss_and_grads(
    const Model& m, const std::vector<Tensor>& X, const std::vector<Tensor>& y,
    const std::vector<const ReplicaState*>& r, const std::vector<Tensor>& grads,
    const std::function<void(size_t, size_t)>& bucket_done, const SyncReplicas& sync,
    const StepRows& rows) {
  const size_t L = r.size();
  MGPU_ASSERT(X.size() == L && y.size() == L && grads.size() == L, "one shard per replica");
  MGPU_ASSERT(rows.first_row.empty() || rows.first_row.size() == L, "one first row per replica");
  const bool synced = m.has_sync() && sync.slots > 1;
  MGPU_ASSERT(!synced || (sync.slot.size() == L && sync.sum), "synchronised replicas need slots");
  const std::vector<int> last_use = last_uses(m);
  std::vector<Pass> ps(L);
  for (size_t d = 0; d < L; ++d) {
    Pass& p = ps[d];
    p.X = X[d], p.y = y[d], p.grads = grads[d], p.r = r[d];
    p.empty = X[d].size(0) == 0;
    if (p.empty) {
      ops::fill(p.grads, 0.0);
      p.loss = Tensor::empty({}, DType::F32, X[d].device());
      ops::fill(p.loss, 0.0);
    } else {
      p.t = start_trace(m, X[d]);
      p.t.seed = rows.seed;
      p.t.first_row = rows.first_row.empty() ? 0 : rows.first_row[d];
    }
  }
  for (size_t i = 0; i < m.layers().size(); ++i) {
    const Layer& l = m.layers()[i];
    if (synced && is_batch_norm(l.kind) && l.sync) exchange_stats(m, i, ps, sync);
    for (Pass& p : ps)
      if (!p.empty) forward_layer(m, i, p.t, *p.r, true, true, last_use);
  }
  for (Pass& p : ps) {
    if (p.empty) continue;
    const Tensor& logits = p.t.slots.back();
    trace::Label label([] { return std::string("loss forward and backward"); });
    Tensor losses = ops::softmax_ce_forward(logits, p.y);
    p.loss = ops::sum(losses);
    // Backward of sum(losses): every per-example loss gets gradient one.
    Tensor dloss = Tensor::empty_like(losses);
    ops::fill(dloss, 1.0);
    p.dslot.resize(static_cast<size_t>(m.num_slots()));
    p.dslot.back() = ops::softmax_ce_backward(logits, p.y, dloss);
  }
  // Forward and loss are enqueued without an error: only now do the running statistics move, so
  // a bad input (too few channels, too small an image) leaves every buffer as it was.
  for (Pass& p : ps)
    if (!p.empty) update_all_running_stats(m, p.t, *p.r);
  const std::vector<bool> reaches = reaches_loss(m);
  size_t next_bucket = 0;
  for (int i = static_cast<int>(m.layers().size()) - 1; i >= 0; --i) {
    const Layer& l = m.layers()[static_cast<size_t>(i)];
    if (synced && is_batch_norm(l.kind) && l.sync && reaches[static_cast<size_t>(l.out)])
      exchange_sums(m, static_cast<size_t>(i), ps, sync);
    for (Pass& p : ps)
      if (!p.empty) backward_layer(m, static_cast<size_t>(i), p);
    while (next_bucket < m.buckets().size() && m.buckets()[next_bucket].last_layer == i) {
      trace::Label bucket([&] {
        const Bucket& k = m.buckets()[next_bucket];
        return "allreduce bucket " + std::to_string(next_bucket) + " (" +
               std::to_string(k.end - k.begin) + " floats)";
      });
      for (size_t d = 0; d < L; ++d) bucket_done(next_bucket, d);
      ++next_bucket;
    }
  }
  std::vector<Tensor> losses;
  for (Pass& p : ps) losses.push_back(p.loss);
  return losses;
}

Tensor model_loss_and_grads(const Model& m, const Tensor& X, const Tensor& y, const ReplicaState& r,
                            const Tensor& grads, const std::function<void(size_t)>& bucket_done,
                            uint64_t seed, int64_t first_row) {
  return replicas_loss_and_grads(m, {X}, {y}, {&r}, {grads},
                                 [&](size_t b, size_t) { bucket_done(b); }, SyncReplicas{},
                                 StepRows{seed, {first_row}})[0];
}

}  // namespace mgpu::train
