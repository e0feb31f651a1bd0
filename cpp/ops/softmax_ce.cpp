// cpp/ops/softmax_ce.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
// On a GPU the labels are device memory, checked by the kernel: it flags the first bad row, and the
// queue reads the flag after the kernels finished (Queue::defer_check), raising the same
// IndexError the CPU raises at the next wait.
#include "ops/softmax_ce.h"

#include "core/gpu.h"
#include "ops/dispatch.h"

namespace mgpu::ops {
namespace {


// Calls fn with the labels' typed pointer.
template <typename Fn>
void with_labels(const Tensor& labels, Fn&& fn) {
  if (labels.dtype() == DType::I64) fn(labels.data<int64_t>());
  else fn(labels.data<int32_t>());
}

// On a GPU: the check of the labels a kernel reads, with the flag it will raise (none on a CPU,
// whose kernels check before they write).
LabelCheck label_check(const char* op, const Tensor& logits, const Tensor& labels) {
  Tensor flag;
  if (!logits.device().is_cpu()) flag = Tensor::empty({}, DType::I32, logits.device());
  return LabelCheck{op, logits.device(), flag, labels, logits.size(1)};
}

}  // namespace

void check_logits_and_labels(const char* op, const Tensor& logits, const Tensor& labels) {
  require_dtype(op, "y_hat (the logits)", logits, DType::F32);
  require_same_device(op, {&logits, &labels});
  MGPU_CHECK_VALUE(logits.dim() == 2, op, ": y_hat must have 2 dims (N, M) -- one row of ",
                   "class scores per example -- got shape ", logits.shape());
  MGPU_CHECK_TYPE(labels.dtype() == DType::I64 || labels.dtype() == DType::I32, op,
                  ": labels y must be int32 or int64 class indices, got ",
                  dtype_name(labels.dtype()));
  MGPU_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == logits.size(0), op,
                   ": labels y must have shape (", logits.size(0), ",) to match y_hat ",
                   logits.shape(), ", got ", labels.shape());
}

void LabelCheck::operator()() const {
  if constexpr (kGpuBuild) {  // the queue has synchronised
    const int index = device.index;
    int32_t row = cuda::kNoBadRow;
    gpu::read_to_host(index, &row, flag.raw(), sizeof row);
    if (row == cuda::kNoBadRow) return;
    int64_t label = 0;
    if (labels.dtype() == DType::I64) {
      gpu::read_to_host(index, &label, labels.data<int64_t>() + row, sizeof label);
    } else {
      int32_t narrow = 0;
      gpu::read_to_host(index, &narrow, labels.data<int32_t>() + row, sizeof narrow);
      label = narrow;
    }
    cuda::check_bad_row(op, row, label, m);
  }
}

LabelCheck LabelCheck::snapshot() const {
  LabelCheck copy{op, device, Tensor::empty_like(flag), Tensor::empty_like(labels), m};
  gpu::copy_within(device.index, copy.flag.raw(), flag.raw(), flag.nbytes());
  if (labels.nbytes())
    gpu::copy_within(device.index, copy.labels.raw(), labels.raw(), labels.nbytes());
  return copy;
}

Tensor softmax_ce_forward(const Tensor& logits, const Tensor& labels) {
  const char* op = "cross_entropy";
  check_logits_and_labels(op, logits, labels);
  Tensor loss = Tensor::empty({logits.size(0)}, DType::F32, logits.device(), op);
  const int64_t n = logits.size(0), m = logits.size(1);
  const float* zp = logits.f32();
  float* lp = loss.f32();
  with_labels(labels, [&](auto* yp) {
    dispatch(logits.device(), op, [=] { cpu::softmax_ce_forward(n, m, zp, yp, lp); },
             [=, check = label_check(op, logits, labels)](cudaStream_t stream) {
               cuda::softmax_ce_forward(n, m, zp, yp, lp, check.flag.data<int32_t>(), stream);
               queue_of(check.device).defer_check(check);
             },
             logits, labels, loss);
  });
  return loss;
}

Tensor softmax_ce_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss) {
  const char* op = "cross_entropy_backward";
  check_logits_and_labels(op, logits, labels);
  require_dtype(op, "dloss", dloss, DType::F32);
  require_same_device(op, {&logits, &dloss});
  MGPU_CHECK_VALUE(dloss.shape() == Shape{logits.size(0)}, op, ": dloss must have shape (",
                   logits.size(0), ",), got ", dloss.shape());
  Tensor dz = Tensor::empty_like(logits);
  const int64_t n = logits.size(0), m = logits.size(1);
  const float *zp = logits.f32(), *dlp = dloss.f32();
  float* dzp = dz.f32();
  with_labels(labels, [&](auto* yp) {
    dispatch(logits.device(), op, [=] { cpu::softmax_ce_backward(n, m, zp, yp, dlp, dzp); },
             [=, check = label_check(op, logits, labels)](cudaStream_t stream) {
               cuda::softmax_ce_backward(n, m, zp, yp, dlp, dzp, check.flag.data<int32_t>(),
                                         stream);
               queue_of(check.device).defer_check(check);
             },
             logits, labels, dloss, dz);
  });
  return dz;
}

}  // namespace mgpu::ops
