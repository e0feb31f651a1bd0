// cpp/train/lenet.cpp -- LeNet forward and backward as a sequence of op calls.
#include "train/lenet.h"

#include "ops/avg_pool2d.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/relu.h"
#include "ops/softmax_ce.h"

namespace mgpu::train {

void check_lenet_params(const char* op, const std::vector<Tensor>& p) {
  MGPU_CHECK_VALUE(p.size() == kLeNetParams, op, ": LeNet takes 8 parameter arrays [W1, b1, W2, "
                   "b2, W3, b3, W4, b4], got ", p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    MGPU_CHECK_VALUE(p[i].defined(), op, ": parameter ", i, " is None");
    require_dtype(op, "every parameter", p[i], DType::F32);
    MGPU_CHECK_VALUE(p[i].device() == p[0].device(), op, ": parameters are on ", p[0].device(),
                     " and ", p[i].device(), "; keep one device's copy together (get_params)");
  }
  const int64_t dims[] = {4, 1, 4, 1, 2, 1, 2, 1};
  for (size_t i = 0; i < p.size(); ++i)
    MGPU_CHECK_VALUE(p[i].dim() == dims[i], op, ": parameter ", i, " must have ", dims[i],
                     " dims, got shape ", p[i].shape());
  MGPU_CHECK_VALUE(p[1].size(0) == p[0].size(0) && p[3].size(0) == p[2].size(0) &&
                   p[5].size(0) == p[4].size(1) && p[7].size(0) == p[6].size(1) &&
                   p[6].size(0) == p[4].size(1) && p[2].size(1) == p[0].size(0),
                   op, ": parameter shapes do not fit together: ", p[0].shape(), " ", p[1].shape(),
                   " ", p[2].shape(), " ", p[3].shape(), " ", p[4].shape(), " ", p[5].shape(), " ",
                   p[6].shape(), " ", p[7].shape());
}

namespace {

// The shapes of the fused CPU path, or false when the op path must run instead: another device,
// or inputs that do not fit (the ops then raise their usual errors).
struct FusedShapes {
  ops::Conv2dShape s1, s2;
};
bool fused_shapes(const Tensor& X, const std::vector<Tensor>& p, FusedShapes* f) {
  if (!X.device().is_cpu()) return false;
  const Tensor &w1 = p[0], &w2 = p[2];
  if (X.size(1) != w1.size(1) || X.size(2) < w1.size(2) || X.size(3) < w1.size(3)) return false;
  f->s1 = {X.size(0), X.size(1), X.size(2), X.size(3), w1.size(0), w1.size(2), w1.size(3), 1, 0};
  const int64_t h1 = f->s1.P() / 2, v1 = f->s1.Q() / 2;
  if (h1 < w2.size(2) || v1 < w2.size(3)) return false;
  f->s2 = {X.size(0), w1.size(0), h1, v1, w2.size(0), w2.size(2), w2.size(3), 1, 0};
  const int64_t h2 = f->s2.P() / 2, v2 = f->s2.Q() / 2;
  return h2 >= 1 && v2 >= 1 && w2.size(0) * h2 * v2 == p[4].size(0);
}

// The activations backward needs. On a CPU device each conv, relu and pool run as one fused
// op (ops/conv2d_relu_pool.h) with the same bits: c1 and c2 then hold relu's mask (uint8, c > 0)
// instead of the conv outputs, and a1, a2 stay undefined (average pooling needs no activations).
struct Trace {
  Tensor X, c1, a1, p1, c2, a2, flat, z3, a3, z4;
  bool fused = false;
  FusedShapes shapes;
};

// for_backward = false (inference) skips what only backward needs: relu's masks.
Trace forward(const Tensor& X, const std::vector<Tensor>& p, bool for_backward) {
  Trace t;
  t.X = X;
  Tensor p2;
  t.fused = fused_shapes(X, p, &t.shapes);
  if (t.fused) {
    ops::Conv2dReluPool b1 = ops::conv2d_relu_pool_forward(X, p[0], p[1], 1, 0, 2, for_backward);
    ops::Conv2dReluPool b2 = ops::conv2d_relu_pool_forward(b1.pooled, p[2], p[3], 1, 0, 2,
                                                           for_backward);
    t.p1 = b1.pooled;
    t.c1 = b1.mask;
    t.c2 = b2.mask;
    p2 = b2.pooled;
  } else {
    t.c1 = ops::conv2d_forward(X, p[0], p[1], 1, 0);
    t.a1 = ops::relu_forward(t.c1);
    t.p1 = ops::avg_pool2d_forward(t.a1, 2, 2, 2, 2);
    t.c2 = ops::conv2d_forward(t.p1, p[2], p[3], 1, 0);
    t.a2 = ops::relu_forward(t.c2);
    p2 = ops::avg_pool2d_forward(t.a2, 2, 2, 2, 2);
  }
  t.flat = p2.reshape({p2.size(0), -1});
  MGPU_CHECK_VALUE(t.flat.size(1) == p[4].size(0), "lenet: the flattened features have ",
                   t.flat.size(1), " columns but W3 has ", p[4].size(0), " rows; X must be (N, ",
                   p[0].size(1), ", 28, 28) for the chapter's LeNet, got ", X.shape());
  t.z3 = ops::binary(ops::BinaryOp::Add, ops::mm(t.flat, p[4]), p[5]);
  t.a3 = ops::relu_forward(t.z3);
  t.z4 = ops::binary(ops::BinaryOp::Add, ops::mm(t.a3, p[6]), p[7]);
  return t;
}

void check_input(const char* op, const Tensor& X, const std::vector<Tensor>& p) {
  check_lenet_params(op, p);
  require_dtype(op, "X", X, DType::F32);
  require_same_device(op, {&X, &p[0]});
  MGPU_CHECK_VALUE(X.dim() == 4, op, ": X must have 4 dims (N, 1, 28, 28), got shape ", X.shape());
}

}  // namespace

Tensor lenet_forward(const Tensor& X, const std::vector<Tensor>& params) {
  check_input("lenet", X, params);
  return forward(X, params, false).z4;
}

LeNetStep lenet_loss_and_grads(const Tensor& X, const Tensor& y, const std::vector<Tensor>& p,
                               const DenseGradsReady& dense_ready) {
  check_input("train_batch", X, p);
  LeNetStep out;
  if (X.size(0) == 0) {
    for (const Tensor& w : p) {
      out.grads.push_back(Tensor::empty_like(w));
      ops::fill(out.grads.back(), 0.0);
    }
    if (dense_ready) dense_ready({out.grads[4], out.grads[5], out.grads[6], out.grads[7]});
    out.loss_sum = Tensor::empty({}, DType::F32, X.device());
    ops::fill(out.loss_sum, 0.0);
    return out;
  }
  Trace t = forward(X, p, true);
  Tensor losses = ops::softmax_ce_forward(t.z4, y);
  out.loss_sum = ops::sum(losses);
  // Backward of sum(losses): every per-example loss gets gradient one.
  Tensor dloss = Tensor::empty_like(losses);
  ops::fill(dloss, 1.0);
  Tensor dz4 = ops::softmax_ce_backward(t.z4, y, dloss);
  Tensor db4 = ops::sum_to_shape(dz4, p[7].shape());
  Tensor dW4 = ops::mm(t.a3, dz4, true, false);
  Tensor da3 = ops::mm(dz4, p[6], false, true);
  Tensor dz3 = ops::relu_backward(t.z3, da3);
  Tensor db3 = ops::sum_to_shape(dz3, p[5].shape());
  Tensor dW3 = ops::mm(t.flat, dz3, true, false);
  Tensor dflat = ops::mm(dz3, p[4], false, true);
  if (dense_ready) dense_ready({dW3, db3, dW4, db4});
  ops::Conv2dGrads g1, g2;
  if (t.fused) {
    const FusedShapes& f = t.shapes;
    Tensor dp2 = dflat.reshape({f.s2.N, f.s2.K, f.s2.P() / 2, f.s2.Q() / 2});
    g2 = ops::conv2d_relu_pool_backward(t.p1, p[2], t.c2, dp2, 1, 0, 2, true);
    g1 = ops::conv2d_relu_pool_backward(X, p[0], t.c1, g2.dx, 1, 0, 2, false);
  } else {
    Shape pooled{t.a2.size(0), t.a2.size(1), (t.a2.size(2) - 2) / 2 + 1,
                 (t.a2.size(3) - 2) / 2 + 1};
    Tensor da2 = ops::avg_pool2d_backward(t.a2, dflat.reshape(pooled), 2, 2, 2, 2);
    Tensor dc2 = ops::relu_backward(t.c2, da2);
    g2 = ops::conv2d_backward(t.p1, p[2], dc2, 1, 0, true, true);
    Tensor da1 = ops::avg_pool2d_backward(t.a1, g2.dx, 2, 2, 2, 2);
    Tensor dc1 = ops::relu_backward(t.c1, da1);
    g1 = ops::conv2d_backward(X, p[0], dc1, 1, 0, false, true);
  }
  out.grads = {g1.dw, g1.db, g2.dw, g2.db, dW3, db3, dW4, db4};
  return out;
}

}  // namespace mgpu::train
