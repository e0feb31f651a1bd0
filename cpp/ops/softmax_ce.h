// cpp/ops/softmax_ce.h -- softmax and cross-entropy as one op, per example (reduction none).
// logits z (N, M), labels y (N,) int32 or int64 in [0, M), loss (N,) = logsumexp(z_i) - z_i[y_i].
// Backward: dz = (softmax(z) - onehot(y)) * dloss[:, None]; it re-reads z, so forward keeps
// nothing. Labels are checked where the data lives (on the device's queue): an out-of-range
// label surfaces as an IndexError at the next wait. Kernels: softmax_ce_cpu.cpp, softmax_ce.cu.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"

namespace mgpu::ops {

// Checks logits (N, M) float32 and labels (N,) int32/int64 on one device, naming `op` (also used
// by argmax.h's correct_count, which takes the same pair).
void check_logits_and_labels(const char* op, const Tensor& logits, const Tensor& labels);
Tensor softmax_ce_forward(const Tensor& logits, const Tensor& labels);
Tensor softmax_ce_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss);

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

namespace cpu {
// loss[i] = logsumexp(z_i) - z_i[label_i], computed from z - max(z) so logits in the thousands
// neither overflow nor lose the small terms; backward writes dlogits = (softmax(z) -
// onehot(label)) * dloss[i]. Labels are checked before anything is written: a label outside
// [0, m) throws std::out_of_range naming the label, its row and m.
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss);
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits);
}  // namespace cpu

namespace cuda {
// One warp per row: max and logsumexp fused (loss = z_top - z_label + log1p(sum_{j != top}
// exp(z_j - z_top)), as on the CPU). The labels live on the device, so they cannot be checked
// before the launch: a label outside [0, m) is never used as an index; its row gets loss NaN
// (backward: a NaN row of dlogits), and if bad_row is not null the launcher first sets *bad_row to
// kNoBadRow and the kernel lowers it to the smallest such row (atomicMin: a flag, not a sum). The
// caller reads *bad_row at its next synchronisation and raises the error cpu:: would have raised
// through check_bad_row.
constexpr int32_t kNoBadRow = 0x7f7f7f7f;  // the int32 whose bytes are all 0x7f (a memset value)
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row, cudaStream_t stream);
// Host side, after synchronising: throws std::out_of_range in cpu::'s words if bad_row_value (the
// downloaded *bad_row) names a row; `label` is that row's label, downloaded by the caller.
void check_bad_row(const char* op, int32_t bad_row_value, int64_t label, int64_t m);
}  // namespace cuda

}  // namespace mgpu::ops
