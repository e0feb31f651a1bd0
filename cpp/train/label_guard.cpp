// cpp/train/label_guard.cpp -- the fused step's label checks and its restore of the state a step
// with a bad label changed (see label_guard.h).
#include "train/label_guard.h"

#include <utility>

#include "core/gpu.h"
#include "core/queue.h"
#include "ops/elementwise.h"
#include "ops/softmax_ce.h"

namespace mgpu::train {

bool labels_checked_on_host(const char* op, const Tensor& y, int64_t classes) {
  if (!y.device().is_cpu() || y.storage()->queued()) return false;
  for (int64_t i = 0; i < y.numel(); ++i) {
    const int64_t label = y.dtype() == DType::I64 ? y.data<int64_t>()[i] : y.data<int32_t>()[i];
    MGPU_CHECK_INDEX(label >= 0 && label < classes, op, ": label ", label, " in row ", i,
                     " is out of range for ", classes, " classes; labels must be class indices "
                     "in [0, ", classes, ")");
  }
  return true;
}

namespace {

// The flag's row and its label, read on the host once the device has computed them.
std::pair<int32_t, int64_t> read_flag_now(const Tensor& flag, const Tensor& labels) {
  const Event done = record_event(flag.device());
  done.queue->wait_done_or_rethrow(done.seq);
  int32_t row = 0;
  int64_t label = 0;
  int32_t narrow = 0;
  const bool wide = labels.dtype() == DType::I64;
  if (flag.device().is_cpu()) {
    row = *flag.data<int32_t>();
    if (row != ops::cuda::kNoBadRow)
      label = wide ? labels.data<int64_t>()[row] : labels.data<int32_t>()[row];
    return {row, label};
  }
  const int index = flag.device().index;
  gpu::read_to_host(index, &row, flag.raw(), sizeof row);
  if (row == ops::cuda::kNoBadRow) return {row, 0};
  if (wide) gpu::read_to_host(index, &label, labels.data<int64_t>() + row, sizeof label);
  else gpu::read_to_host(index, &narrow, labels.data<int32_t>() + row, sizeof narrow);
  return {row, wide ? label : narrow};
}

}  // namespace

LabelGuard start_guard(const char* op, int64_t classes, const Tensor& y,
                       const std::vector<Replica>& replicas, const Sgd& sgd) {
  LabelGuard g;
  bool first_momentum = false;
  for (const Replica& r : replicas) {
    g.labels.push_back(ops::to_device(y, r.device));
    g.flags.push_back(ops::find_bad_label(g.labels.back(), classes));
    const bool needs_momentum = !sgd.sum_rule && (sgd.momentum != 0.0f || sgd.adam());
    first_momentum = first_momentum || (needs_momentum && !r.momentum.defined()) ||
                     (sgd.adam() && !r.second.defined()) ||
                     (sgd.adam() && sgd.amsgrad && !r.max_second.defined());
  }
  // A first step with momentum creates the buffers, which a failed step must not leave behind:
  // this once, the host waits for the verdict.
  if (first_momentum) {
    auto [row, label] = read_flag_now(g.flags[0], g.labels[0]);
    MGPU_CHECK_INDEX(row == ops::cuda::kNoBadRow, op, ": label ", label, " in row ", row,
                     " is out of range for ", classes, " classes; labels must be class indices "
                     "in [0, ", classes, ")");
  }
  for (const Replica& r : replicas) {
    std::vector<Tensor> state = r.state.params, saved;
    state.insert(state.end(), r.state.buffers.begin(), r.state.buffers.end());
    if (r.momentum.defined()) state.push_back(r.momentum);
    if (r.second.defined()) state.push_back(r.second);
    if (r.max_second.defined()) state.push_back(r.max_second);
    for (const Tensor& t : state) saved.push_back(ops::to_device(t, r.device, true));
    g.state.push_back(std::move(state));
    g.saved.push_back(std::move(saved));
  }
  return g;
}

void finish_guard(const char* op, const LabelGuard& g, int64_t classes,
                  const std::vector<Tensor>& losses) {
  for (size_t d = 0; d < g.flags.size(); ++d) {
    for (size_t j = 0; j < g.state[d].size(); ++j)
      ops::restore_if_flagged(g.state[d][j], g.saved[d][j], g.flags[d]);
    ops::raise_if_flagged(op, g.flags[d], g.labels[d], classes, losses[d]);
  }
}

}  // namespace mgpu::train
