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
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/relu.h"
#include "ops/softmax_ce.h"

namespace mgpu::train {
namespace {

// The fused kernel runs on CPU devices when the shapes fit; elsewhere (GPUs) and for shapes that
// do not fit the layer runs conv2d, relu and avg_pool2d, whose checks then report the problem.
bool fused_fits(const Tensor& x, const Tensor& w, int64_t pool) {
  if (!x.device().is_cpu() || x.dim() != 4 || x.size(1) != w.size(1)) return false;
  const int64_t p = x.size(2) - w.size(2) + 1, q = x.size(3) - w.size(3) + 1;
  return p >= pool && q >= pool;
}

// What a layer's backward needs beyond its inputs: the fused layer's relu mask (or, unfused, the
// conv and relu outputs), batch norm's batch mean and variance.
struct Saved {
  Tensor a, b;
};

// Batch norm in training mode: normalise with the batch statistics (kept in s for backward) and
// move the running ones towards them in place, PyTorch's way (running var unbiased).
Tensor batch_norm_train(const Layer& l, const Tensor& x, const Tensor* gamma, const Tensor* beta,
                        const Tensor& running_mean, const Tensor& running_var, Saved* s) {
  const double count = static_cast<double>(x.numel() / x.size(1));
  MGPU_CHECK_VALUE(count > 1, l.name, ": expected more than 1 value per channel when training, "
                   "got input of shape ", x.shape(), "; use a bigger batch per device");
  std::tie(s->a, s->b) = ops::batch_norm_stats(x);
  Tensor y = ops::batch_norm_forward(x, s->a, s->b, gamma, beta, static_cast<float>(l.eps));
  const auto m = static_cast<float>(l.momentum);
  ops::binary_scalar_inplace(ops::BinaryOp::Mul, running_mean, 1.0f - m);
  ops::binary_inplace(ops::BinaryOp::Add, running_mean,
                      ops::binary_scalar(ops::BinaryOp::Mul, s->a, m, false));
  ops::binary_scalar_inplace(ops::BinaryOp::Mul, running_var, 1.0f - m);
  ops::binary_inplace(ops::BinaryOp::Add, running_var,
                      ops::binary_scalar(ops::BinaryOp::Mul, s->b,
                                         static_cast<float>(m * count / (count - 1)), false));
  return y;
}

Tensor forward(const Layer& l, const std::vector<Tensor>& in, const ReplicaState& r,
               bool training, bool for_backward, Saved* s) {
  auto p = [&](size_t i) -> const Tensor& { return r.params[static_cast<size_t>(l.params[i])]; };
  const Tensor& x = in[0];
  switch (l.kind) {
    case LayerKind::Conv2d:
      return ops::conv2d_forward(x, p(0), l.bias ? p(1) : Tensor(), l.stride, l.padding);
    case LayerKind::Conv2dReluPool: {
      if (fused_fits(x, p(0), l.kh)) {
        ops::Conv2dReluPool f = ops::conv2d_relu_pool_forward(x, p(0), p(1), 1, 0, l.kh,
                                                              for_backward);
        s->a = f.mask;
        return f.pooled;
      }
      s->a = ops::conv2d_forward(x, p(0), p(1), 1, 0);
      s->b = ops::relu_forward(s->a);
      return ops::avg_pool2d_forward(s->b, l.kh, l.kh, l.kh, l.kh);
    }
    case LayerKind::BatchNorm: {
      MGPU_CHECK_VALUE(x.dim() == 4 || x.dim() == 2, l.name, ": expects (N, C, H, W) or (N, C), "
                       "got shape ", x.shape());
      const Tensor* gamma = l.bias ? &p(0) : nullptr;
      const Tensor* beta = l.bias ? &p(1) : nullptr;
      const Tensor& rm = r.buffers[static_cast<size_t>(l.buffers[0])];
      const Tensor& rv = r.buffers[static_cast<size_t>(l.buffers[1])];
      MGPU_CHECK_VALUE(x.size(1) == rm.size(0), l.name, ": the input has ", x.size(1),
                       " channels but the layer normalises ", rm.size(0));
      if (training) return batch_norm_train(l, x, gamma, beta, rm, rv, s);
      return ops::batch_norm_forward(x, rm, rv, gamma, beta, static_cast<float>(l.eps));
    }
    case LayerKind::Relu: return ops::relu_forward(x);
    case LayerKind::AvgPool2d: return ops::avg_pool2d_forward(x, l.kh, l.kw, l.sh, l.sw);
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
      Tensor z = ops::mm(x, p(0), false, l.transpose);
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

// Given dy, writes the inputs' gradients (dx[k], left undefined where need_dx[k] is false) and
// the parameters' (dp, in the layer's parameter order).
void backward(const Layer& l, const std::vector<Tensor>& in, const Tensor& out, const Tensor& dy,
              const ReplicaState& r, const Saved& s, const std::vector<bool>& need_dx,
              std::vector<Tensor>* dx, std::vector<Tensor>* dp) {
  auto p = [&](size_t i) -> const Tensor& { return r.params[static_cast<size_t>(l.params[i])]; };
  const Tensor& x = in[0];
  Tensor& dx0 = (*dx)[0];
  switch (l.kind) {
    case LayerKind::Conv2d: {
      ops::Conv2dGrads g =
          ops::conv2d_backward(x, p(0), dy, l.stride, l.padding, need_dx[0], l.bias);
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
        g = ops::conv2d_backward(x, p(0), dc, 1, 0, need_dx[0], true);
      }
      dx0 = g.dx;
      *dp = {g.dw, g.db};
      return;
    }
    case LayerKind::BatchNorm: {
      const auto eps = static_cast<float>(l.eps);
      auto [sum_dy, sum_dy_xhat] = ops::batch_norm_backward_reduce(x, dy, s.a, s.b, eps);
      const double count = static_cast<double>(x.numel() / x.size(1));
      if (need_dx[0])
        dx0 = ops::batch_norm_backward(x, dy, s.a, s.b, l.bias ? &p(0) : nullptr, sum_dy,
                                       sum_dy_xhat, count, eps, true);
      if (l.bias) *dp = {sum_dy_xhat, sum_dy};
      return;
    }
    case LayerKind::Relu: dx0 = ops::relu_backward(x, dy); return;
    case LayerKind::AvgPool2d:
      dx0 = ops::avg_pool2d_backward(x, dy, l.kh, l.kw, l.sh, l.sw);
      return;
    case LayerKind::GlobalAvgPool:
      dx0 = ops::avg_pool2d_backward(x, dy, x.size(2), x.size(3), x.size(2), x.size(3));
      return;
    case LayerKind::Flatten: dx0 = dy.reshape(x.shape()); return;
    case LayerKind::Linear: {
      // y = x W (+ b) with W (in, out), or y = x W^T (+ b) with W (out, in) when transposed.
      Tensor dW = l.transpose ? ops::mm(dy, x, true, false) : ops::mm(x, dy, true, false);
      if (need_dx[0]) dx0 = ops::mm(dy, p(0), false, !l.transpose);
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
  (void)out;
}

// The view of parameter p's gradient in the flat buffer.
Tensor grad_view(const Model& m, const Tensor& grads, const ReplicaState& r, size_t p) {
  const int64_t at = m.offset(p), n = r.params[p].numel();
  return grads.slice_rows(at, at + n).reshape(r.params[p].shape());
}

struct Trace {
  std::vector<Tensor> slots;
  std::vector<Saved> saved;
};

Trace run_forward(const Model& m, const Tensor& X, const ReplicaState& r, bool training,
                  bool for_backward) {
  require_dtype("Model", "X", X, DType::F32);
  Trace t;
  t.slots.resize(static_cast<size_t>(m.num_slots()));
  t.saved.resize(m.layers().size());
  t.slots[0] = X;
  // The last forward reader of each slot, so slots backward does not need are released early.
  std::vector<int> last_use(static_cast<size_t>(m.num_slots()), -1);
  for (size_t i = 0; i < m.layers().size(); ++i)
    for (int s : m.layers()[i].in) last_use[static_cast<size_t>(s)] = static_cast<int>(i);
  for (size_t i = 0; i < m.layers().size(); ++i) {
    const Layer& l = m.layers()[i];
    std::vector<Tensor> in;
    for (int s : l.in) in.push_back(t.slots[static_cast<size_t>(s)]);
    try {
      trace::Label label([&] { return l.name + (training ? " forward" : " forward (eval)"); });
      t.slots[static_cast<size_t>(l.out)] = forward(l, in, r, training, for_backward, &t.saved[i]);
    } catch (const ValueError& e) {
      // An op's message about its shapes, prefixed with the layer that called it.
      if (std::string(e.what()).rfind(l.name, 0) == 0) throw;
      throw ValueError(l.name + ": " + e.what());
    }
    for (int s : l.in)
      if (last_use[static_cast<size_t>(s)] == static_cast<int>(i) &&
          !(for_backward && m.saved(s)))
        t.slots[static_cast<size_t>(s)] = Tensor();
  }
  return t;
}

}  // namespace

Tensor model_forward(const Model& m, const Tensor& X, const ReplicaState& r, bool training) {
  return run_forward(m, X, r, training, false).slots.back();
}

Tensor model_loss_and_grads(const Model& m, const Tensor& X, const Tensor& y, const ReplicaState& r,
                            const Tensor& grads, const std::function<void(size_t)>& bucket_done) {
  if (X.size(0) == 0) {
    ops::fill(grads, 0.0);
    for (size_t b = 0; b < m.buckets().size(); ++b) bucket_done(b);
    Tensor zero = Tensor::empty({}, DType::F32, X.device());
    ops::fill(zero, 0.0);
    return zero;
  }
  Trace t = run_forward(m, X, r, true, true);
  const Tensor& logits = t.slots.back();
  std::vector<Tensor> dslot(static_cast<size_t>(m.num_slots()));
  Tensor loss_sum;
  {
    trace::Label label([] { return std::string("loss forward and backward"); });
    Tensor losses = ops::softmax_ce_forward(logits, y);
    loss_sum = ops::sum(losses);
    // Backward of sum(losses): every per-example loss gets gradient one.
    Tensor dloss = Tensor::empty_like(losses);
    ops::fill(dloss, 1.0);
    dslot.back() = ops::softmax_ce_backward(logits, y, dloss);
  }
  size_t next_bucket = 0;
  for (int i = static_cast<int>(m.layers().size()) - 1; i >= 0; --i) {
    const Layer& l = m.layers()[static_cast<size_t>(i)];
    Tensor dy = std::move(dslot[static_cast<size_t>(l.out)]);
    t.slots[static_cast<size_t>(l.out)] = Tensor();
    trace::Label label([&] { return l.name + " backward"; });
    if (dy.defined()) {
      std::vector<Tensor> in, dx(l.in.size()), dp;
      std::vector<bool> need_dx;
      for (int s : l.in) {
        in.push_back(t.slots[static_cast<size_t>(s)]);
        need_dx.push_back(m.grad_needed(s));
      }
      backward(l, in, Tensor(), dy, r, t.saved[static_cast<size_t>(i)], need_dx, &dx, &dp);
      t.saved[static_cast<size_t>(i)] = Saved();
      for (size_t k = 0; k < l.in.size(); ++k) {
        if (!need_dx[k] || !dx[k].defined()) continue;
        Tensor& acc = dslot[static_cast<size_t>(l.in[k])];
        // A slot read by several layers gets the sum of their gradients.
        acc = acc.defined() ? ops::binary(ops::BinaryOp::Add, acc, dx[k]) : dx[k];
      }
      for (size_t j = 0; j < dp.size(); ++j) {
        const size_t p = static_cast<size_t>(l.params[j]);
        ops::copy(grad_view(m, grads, r, p), dp[j]);
      }
    } else {
      // The layer does not reach the loss: its parameters' gradients are zero.
      for (int p : l.params) ops::fill(grad_view(m, grads, r, static_cast<size_t>(p)), 0.0);
    }
    while (next_bucket < m.buckets().size() && m.buckets()[next_bucket].last_layer == i) {
      trace::Label bucket([&] {
        const Bucket& k = m.buckets()[next_bucket];
        return "allreduce bucket " + std::to_string(next_bucket) + " (" +
               std::to_string(k.end - k.begin) + " floats)";
      });
      bucket_done(next_bucket++);
    }
  }
  return loss_sum;
}

}  // namespace mgpu::train
