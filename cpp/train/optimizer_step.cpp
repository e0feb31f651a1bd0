// cpp/train/optimizer_step.cpp -- the fused step's update of the replicas (see optimizer_step.h):
// per replica through the ops' optimizer steps, or block by block inside the shared update.
#include "train/optimizer_step.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "comm/shared_update.h"
#include "ops/elementwise.h"

namespace mgpu::train {
namespace {

// Parameter p's slice of a flat buffer laid out as the model's gradients.
Tensor view(const Model& m, const Tensor& flat, const Tensor& p, size_t i) {
  return flat.slice_rows(m.offset(i), m.offset(i) + p.numel()).reshape(p.shape());
}

// A flat buffer like the gradients, zeroed: a zeroed momentum buffer makes the first step
// PyTorch's buf = g, zeroed moments make Adam's first step PyTorch's.
void make_zeroed(const Model& m, Tensor& t, Device device) {
  if (t.defined()) return;
  t = Tensor::empty({m.flat_size()}, DType::F32, device);
  ops::fill(t, 0.0);
}

ops::AdamHyper adam_hyper(const Sgd& sgd, size_t i) {
  ops::AdamHyper h;
  h.lr = sgd.lr_of(i);
  h.beta1 = sgd.beta1;
  h.beta2 = sgd.beta2;
  h.eps = sgd.eps;
  h.weight_decay = sgd.weight_decay_of(i);
  h.decoupled = sgd.kind == Sgd::Kind::AdamW;
  h.step = sgd.step;
  return h;
}

// Parameter i's SGD hyperparameters and the batch its gradient is divided by: the chapter's rule
// p -= lr / N * g as batch 1 with lr / N (the scale the chapter's sgd forms: grad / 1 is grad
// exactly), else PyTorch's SGD on the mean loss over N.
std::pair<ops::SgdHyper, float> sgd_hyper(const Sgd& sgd, size_t i, float batch) {
  ops::SgdHyper h;
  if (sgd.sum_rule) {
    h.lr = sgd.lr / batch;
    return {h, 1.0f};
  }
  h.lr = sgd.lr_of(i);
  h.momentum = sgd.momentum;
  h.weight_decay = sgd.weight_decay_of(i);
  return {h, batch};
}

// The optimizer on flat elements of every replica, block by block (comm::SharedUpdate::update).
struct BlockUpdate {
  std::vector<std::vector<float*>> params;  // params[d][i]: replica d's parameter i
  // Per replica, flat, or null where the optimizer keeps none: SGD's momentum or Adam's m; v;
  // amsgrad's running maximum of v.
  std::vector<float*> momentum, second, max_second;
  // Parameter order[j] lies at flat [offsets[j], ends[j]), in flat order (the layout puts the
  // last layer's first, for the buckets).
  std::vector<size_t> order;
  std::vector<int64_t> offsets, ends;
  std::vector<ops::AdamStep> adam;  // per parameter: its Adam scalars (pointers null)
  Sgd sgd;
  float batch = 1.0f;

  // Flat elements [f0, f0 + n), one block: the optimizer on every replica, with the summed
  // gradients sum[0, n) and the clip factor (null: none).
  void operator()(int64_t f0, int64_t n, const float* sum, const float* clip) const {
    const int64_t f1 = f0 + n;
    const size_t first =
        static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), f0) - ends.begin());
    for (size_t j = first; j < offsets.size() && offsets[j] < f1; ++j) {
      const int64_t a = std::max(f0, offsets[j]), b = std::min(f1, ends[j]);
      if (a >= b) continue;  // a parameter without elements
      const size_t i = order[j];
      const float* g = sum + (a - f0);
      for (size_t d = 0; d < params.size(); ++d) {
        float* p = params[d][i] + (a - offsets[j]);
        if (sgd.adam() && !sgd.sum_rule) {
          ops::AdamStep step = adam[i];
          step.param = p;
          step.grad = g;
          step.m = momentum[d] + a;
          step.v = second[d] + a;
          step.vmax = max_second[d] ? max_second[d] + a : nullptr;
          step.clip = clip;
          ops::cpu::adam_step(0, b - a, step);
        } else {
          float* buf = momentum[d];
          const auto [h, over] = sgd_hyper(sgd, i, batch);
          ops::SgdStep step = ops::sgd_body(h, over);
          step.param = p;
          step.grad = g;
          step.buf = buf ? buf + a : nullptr;
          step.clip = clip;
          ops::cpu::sgd_step(0, b - a, step);
        }
      }
    }
  }
};

}  // namespace

void update(const Model& m, Replica& r, const Tensor& grads, const Sgd& sgd, int64_t batch) {
  const std::vector<Tensor>& ps = r.state.params;
  if (sgd.sum_rule) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto [h, over] = sgd_hyper(sgd, i, static_cast<float>(batch));
      ops::sgd_step(ps[i], view(m, grads, ps[i], i), Tensor(), over, h);
    }
    return;
  }
  // Every replica holds the same summed gradients, so each forms the same clip factor itself.
  const Tensor clip = sgd.clip ? ops::clip_factor(grads, 1.0f / static_cast<float>(batch),
                                                  sgd.max_norm)
                               : Tensor();
  if (sgd.adam()) {
    make_zeroed(m, r.momentum, r.device);
    make_zeroed(m, r.second, r.device);
    if (sgd.amsgrad) make_zeroed(m, r.max_second, r.device);
    for (size_t i = 0; i < ps.size(); ++i)
      ops::adam_step(ps[i], view(m, grads, ps[i], i), view(m, r.momentum, ps[i], i),
                     view(m, r.second, ps[i], i), static_cast<float>(batch), adam_hyper(sgd, i),
                     clip, sgd.amsgrad ? view(m, r.max_second, ps[i], i) : Tensor());
    return;
  }
  // One pass per parameter, nothing allocated but the clip factor.
  const bool with_buf = sgd.momentum != 0.0f;
  if (with_buf) make_zeroed(m, r.momentum, r.device);
  for (size_t i = 0; i < ps.size(); ++i) {
    const Tensor buf = with_buf ? view(m, r.momentum, ps[i], i) : Tensor();
    const auto [h, over] = sgd_hyper(sgd, i, static_cast<float>(batch));
    ops::sgd_step(ps[i], view(m, grads, ps[i], i), buf, over, h, clip);
  }
}

void shared_update(const Model& m, std::vector<Replica>& replicas, const std::vector<Tensor>& grads,
                   const Sgd& sgd, int64_t batch) {
  const size_t k = replicas.size();
  auto up = std::make_shared<BlockUpdate>();
  up->sgd = sgd;
  up->batch = static_cast<float>(batch);
  for (size_t i = 0; i < m.num_params(); ++i) {
    up->order.push_back(i);
    // Checked here, before anything is enqueued, as adam_step checks.
    if (sgd.adam() && !sgd.sum_rule)
      up->adam.push_back(ops::adam_body(sgd.kind == Sgd::Kind::AdamW ? "adamw" : "adam",
                                        adam_hyper(sgd, i), up->batch));
  }
  std::sort(up->order.begin(), up->order.end(),
            [&m](size_t a, size_t b) { return m.offset(a) < m.offset(b); });
  for (size_t i : up->order) {
    up->offsets.push_back(m.offset(i));
    up->ends.push_back(m.offset(i) + replicas[0].state.params[i].numel());
  }
  auto sh = std::make_shared<comm::SharedUpdate>(static_cast<int>(k));
  sh->total = m.flat_size();
  if (sgd.clip && !sgd.sum_rule) {
    sh->block_squares.assign(
        static_cast<size_t>((sh->total + ops::kElementBlock - 1) / ops::kElementBlock), 0.0);
    sh->clip = [scale = 1.0f / up->batch, max_norm = sgd.max_norm](double squares) {
      return ops::clip_coefficient(static_cast<float>(squares), scale, max_norm);
    };
  }
  std::vector<Device> devices;
  std::vector<std::vector<Tensor>> keep;
  for (size_t d = 0; d < k; ++d) {
    Replica& r = replicas[d];
    // As update(): the optimizer's state is made, zeroed, at the first step that needs it.
    const bool adam = sgd.adam() && !sgd.sum_rule;
    const bool with_buf = adam || (sgd.momentum != 0.0f && !sgd.sum_rule);
    if (with_buf) make_zeroed(m, r.momentum, r.device);
    if (adam) make_zeroed(m, r.second, r.device);
    if (adam && sgd.amsgrad) make_zeroed(m, r.max_second, r.device);
    sh->grads.push_back(grads[d].f32());
    if (sgd.comm_dtype == DType::BF16) {
      const Tensor g16 = Tensor::empty({m.flat_size()}, DType::BF16, r.device, "shared update");
      sh->grads16.push_back(g16.data<BFloat16>());
      keep.push_back({g16});  // extended below with the replica's own tensors
    } else {
      keep.emplace_back();
    }
    std::vector<float*> ps;
    for (const Tensor& p : r.state.params) ps.push_back(p.f32());
    up->params.push_back(std::move(ps));
    up->momentum.push_back(with_buf ? r.momentum.f32() : nullptr);
    up->second.push_back(adam ? r.second.f32() : nullptr);
    up->max_second.push_back(adam && sgd.amsgrad ? r.max_second.f32() : nullptr);
    devices.push_back(r.device);
    keep.back().insert(keep.back().end(), r.state.params.begin(), r.state.params.end());
    keep.back().push_back(grads[d]);
    for (const Tensor* t : {&r.momentum, &r.second, &r.max_second})
      if (t->defined()) keep.back().push_back(*t);
  }
  sh->update = [up](int64_t f0, int64_t n, const float* sum, const float* clip) {
    (*up)(f0, n, sum, clip);
  };
  comm::enqueue_shared_update(sh, devices, keep,
                              sgd.adam() ? "allreduce and adam" : "allreduce and sgd");
}

void share_buffers(std::vector<Replica>& replicas) {
  std::vector<std::vector<Tensor>> buffers;
  for (const Replica& r : replicas) buffers.push_back(r.state.buffers);
  comm::share_first(buffers);
}

}  // namespace mgpu::train
