// cpp/ops/softmax_ce.h -- softmax and cross-entropy as one op, per example (reduction none).
// logits z (N, M), labels y (N,) int32 or int64 in [0, M), loss (N,) = logsumexp(z_i) - z_i[y_i].
// Backward: dz = (softmax(z) - onehot(y)) * dloss[:, None]; it re-reads z, so forward keeps
// nothing. Labels are checked where the data lives (on the device's queue): an out-of-range
// label surfaces as an IndexError at the next wait.
#pragma once

#include "core/tensor.h"

namespace mgpu::ops {

Tensor softmax_ce_forward(const Tensor& logits, const Tensor& labels);
Tensor softmax_ce_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss);

// Index of the largest entry along the last axis of a 1-d or 2-d tensor (first one on ties).
Tensor argmax(const Tensor& x);
// How many rows of logits have their argmax equal to the label, as a 0-d float32 tensor.
Tensor correct_count(const Tensor& logits, const Tensor& labels);

// A GPU cross-entropy's label check, deferred to the queue's next wait (Queue::defer_check): the
// kernel's bad-row flag and the labels it read. Calling it raises IndexError as the CPU would.
// snapshot() -- on the device's worker, after the kernel was issued -- copies both on the stream,
// so a CUDA graph replayed again before anyone waits keeps each replay's own verdict.
struct LabelCheck {
  const char* op;
  Device device;
  Tensor flag, labels;
  int64_t m;
  void operator()() const;
  LabelCheck snapshot() const;
};

}  // namespace mgpu::ops
