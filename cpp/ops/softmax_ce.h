// cpp/ops/softmax_ce.h -- softmax and cross-entropy as one op, per example (reduction none).
// logits z (N, M), labels y (N,) int32 or int64 in [0, M), loss (N,) = logsumexp(z_i) - z_i[y_i].
// Backward: dz = (softmax(z) - onehot(y)) * dloss[:, None]; it re-reads z, so forward keeps
// nothing. Labels are checked where the data lives (on the device's queue): an out-of-range
// label surfaces as an IndexError at the next wait. Kernels: softmax_ce_cpu.cpp, softmax_ce.cu.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"
#include "ops/dispatch.h"

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

// A fused step's label guard (train/label_guard.h), for labels the host cannot read without
// waiting (on a GPU, or written by a queued task). All three run on the device's queue.
// find_bad_label: a 0-d int32 on the labels' device, the first row whose label is outside [0, m),
// or cuda::kNoBadRow when every label is in range.
Tensor find_bad_label(const Tensor& labels, int64_t m);
// dst = src (float32, same shape, dst's device) where flag names a bad row; else nothing: puts a
// failed step's state back from the copies taken before it.
void restore_if_flagged(const Tensor& dst, const Tensor& src, const Tensor& flag);
// Once the device has run everything before it (a GPU: at the queue's next wait), raises the
// IndexError of the row flag names (naming `op`, the label and m) and leaves it on `poison`, a
// result of the failed step, so every later read of it raises too (sticky).
void raise_if_flagged(const char* op, const Tensor& flag, const Tensor& labels, int64_t m,
                      const Tensor& poison);

struct RestoreIfFlagged {
  float* dst; const float* src; const int32_t* flag;
  MGPU_HD void operator()(int64_t i) const {
    if (*flag != 0x7f7f7f7f) dst[i] = src[i];  // cuda::kNoBadRow
  }
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
// find_bad_label's kernel: *bad_row = the smallest row with a label outside [0, m), or kNoBadRow.
void find_bad_label(int64_t n, int64_t m, const int64_t* labels, int32_t* bad_row,
                    cudaStream_t stream);
void find_bad_label(int64_t n, int64_t m, const int32_t* labels, int32_t* bad_row,
                    cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
