// cpp/train/layers.cpp -- the walk of a Model's program: slots forward, gradients backward
// (summed where a slot fans out), each layer through its kind's record (train/layer_kind.h), and
// the exchanges of synchronised layers between the replicas of a step.
#include "train/layers.h"

#include <string>
#include <tuple>

#include "core/trace.h"
#include "ops/batch_norm.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"

namespace mgpu::train {
namespace {

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
  if (l.kind == &absorbed_layer) return;  // its work runs in the fused layer after it
  std::vector<Tensor> in;
  for (int s : l.in) in.push_back(t.slots[static_cast<size_t>(s)]);
  try {
    trace::Label label([&] { return l.name + (training ? " forward" : " forward (eval)"); });
    const LayerCall call{l, in, r, dropout_key(l, t), training, for_backward};
    t.slots[static_cast<size_t>(l.out)] = l.kind->forward(call, &t.saved[i]);
  } catch (const ValueError& e) {
    // An op's message about its shapes, prefixed with the layer that called it.
    if (std::string(e.what()).rfind(l.name, 0) == 0) throw;
    throw ValueError(l.name + ": " + e.what());
  }
  for (int s : l.in)
    if (last_use[static_cast<size_t>(s)] == static_cast<int>(i) && !(for_backward && m.saved(s)))
      t.slots[static_cast<size_t>(s)] = Tensor();
}

// Moves every layer's buffers (batch norm's running statistics) after a training forward.
void update_all_buffers(const Model& m, const Trace& t, const ReplicaState& r) {
  const std::vector<Tensor> none;
  for (size_t i = 0; i < m.layers().size(); ++i) {
    const Layer& l = m.layers()[i];
    if (l.kind->update_buffers) l.kind->update_buffers(LayerCall{l, none, r, {}}, t.saved[i]);
  }
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
  if (l.kind == &absorbed_layer) return;
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
  l.kind->backward(LayerCall{l, in, *p.r, dropout_key(l, t)}, out, dy, t.saved[i], need_dx, &dx,
                   &dp);
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

// The call of synchronised layer i on replica pass p (its input slots as forward left them).
LayerCall sync_call(const Model& m, size_t i, const Pass& p, std::vector<Tensor>* in) {
  const Layer& l = m.layers()[i];
  for (int s : l.in) in->push_back(p.empty ? Tensor() : p.t.slots[static_cast<size_t>(s)]);
  return LayerCall{l, *in, *p.r, {}};
}

// Forward of a synchronised layer (batch norm): every replica's (count, mean, var) per channel
// gathered, combined into the statistics of all examples, kept in each replica's Saved for the
// layer's forward and backward.
void exchange_stats(const Model& m, size_t i, std::vector<Pass>& ps, const SyncReplicas& sync) {
  const Layer& l = m.layers()[i];
  std::vector<Tensor> parts;
  double local = 0.0;  // values per channel in one example, from a local x
  for (Pass& p : ps) {
    std::vector<Tensor> in;
    const LayerCall c = sync_call(m, i, p, &in);
    const int64_t C = l.kind->sync_channels(c);
    const int64_t w = 1 + 2 * C;
    const Device dev = p.r->params[0].device();
    if (p.empty) {
      parts.push_back(padded_row(dev, sync.slots, 0, w, nullptr));
      continue;
    }
    double n = 0.0;
    auto [mean, var] = l.kind->sync_stats(c, &n);
    local = n / static_cast<double>(in[0].size(0));
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

// Backward of a synchronised layer: every replica's (sum_dy, sum_dy_xhat) gathered and added.
void exchange_sums(const Model& m, size_t i, std::vector<Pass>& ps, const SyncReplicas& sync) {
  const Layer& l = m.layers()[i];
  std::vector<Tensor> parts;
  for (Pass& p : ps) {
    std::vector<Tensor> in;
    const LayerCall c = sync_call(m, i, p, &in);
    const int64_t C = l.kind->sync_channels(c);
    const Device dev = p.r->params[0].device();
    if (p.empty) {
      parts.push_back(padded_row(dev, sync.slots, 0, 2 * C, nullptr));
      continue;
    }
    Saved& s = p.t.saved[i];
    const Tensor& dy = p.dslot[static_cast<size_t>(l.out)];
    MGPU_ASSERT(dy.defined(), l.name, ": no gradient reached a synchronised batch norm");
    std::tie(s.part_dy, s.part_dy_xhat) =
        l.kind->sync_sums(c, p.t.slots[static_cast<size_t>(l.out)], dy, s);
    parts.push_back(padded_row(dev, sync.slots, sync.slot[&p - ps.data()], 2 * C,
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
  if (training) update_all_buffers(m, t, r);
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
    if (synced && l.sync) exchange_stats(m, i, ps, sync);
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
    if (!p.empty) update_all_buffers(m, p.t, *p.r);
  const std::vector<bool> reaches = reaches_loss(m);
  size_t next_bucket = 0;
  for (int i = static_cast<int>(m.layers().size()) - 1; i >= 0; --i) {
    const Layer& l = m.layers()[static_cast<size_t>(i)];
    if (synced && l.sync && reaches[static_cast<size_t>(l.out)])
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
