// cpp/ops/softmax_ce.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
// On a GPU the labels are device memory, checked by the kernel: it flags the first bad row, and the
// queue reads the flag after the kernels finished (Queue::defer_check), raising the same
// IndexError the CPU raises at the next wait.
#include "ops/softmax_ce.h"

#include <stdexcept>
#include <string>

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

Tensor find_bad_label(const Tensor& labels, int64_t m) {
  const char* op = "find_bad_label";
  MGPU_CHECK_TYPE(labels.dtype() == DType::I64 || labels.dtype() == DType::I32, op,
                  ": labels must be int32 or int64, got ", dtype_name(labels.dtype()));
  Tensor flag = Tensor::empty({}, DType::I32, labels.device(), op);
  const int64_t n = labels.numel();
  int32_t* fp = flag.data<int32_t>();
  with_labels(labels, [&](auto* yp) {
    dispatch(labels.device(), op, [=] {
               int32_t row = cuda::kNoBadRow;
               for (int64_t i = 0; i < n && row == cuda::kNoBadRow; ++i)
                 if (yp[i] < 0 || yp[i] >= m) row = static_cast<int32_t>(i);
               *fp = row;
             },
             [=](cudaStream_t stream) { cuda::find_bad_label(n, m, yp, fp, stream); }, labels,
             flag);
  });
  return flag;
}

void restore_if_flagged(const Tensor& dst, const Tensor& src, const Tensor& flag) {
  const char* op = "restore_if_flagged";
  require_dtype(op, "dst", dst, DType::F32);
  require_dtype(op, "src", src, DType::F32);
  MGPU_CHECK_VALUE(dst.shape() == src.shape() && flag.dtype() == DType::I32 && flag.numel() == 1,
                   op, ": dst ", dst.shape(), " and src ", src.shape(), " differ, or the flag is "
                   "not a 0-d int32");
  require_same_device(op, {&dst, &src, &flag});
  for_each_index(op, dst.device(), dst.numel(),
                 RestoreIfFlagged{dst.f32(), src.f32(), flag.data<int32_t>()}, dst, src, flag);
}

namespace {

// Raises the flagged row's error in cross_entropy's words, after leaving it on `poison` as a
// failed task leaves its error on its outputs (the queue wraps what is thrown the same way).
[[noreturn]] void fail_bad_row(const char* op, Device device, int32_t row, int64_t label,
                               int64_t m, const Tensor& poison) {
  try {
    cuda::check_bad_row(op, row, label, m);
  } catch (...) {
    if (poison.defined()) poison.storage()->fail(wrap_failure(op, device, std::current_exception()));
    throw;
  }
  throw std::logic_error("fail_bad_row: row " + std::to_string(row) + " is not flagged");
}

}  // namespace

void raise_if_flagged(const char* op, const Tensor& flag, const Tensor& labels, int64_t m,
                      const Tensor& poison) {
  const Device dev = flag.device();
  MGPU_CHECK_VALUE(labels.device() == dev, op, ": the labels must be on the flag's device ", dev);
  if (dev.is_cpu()) {
    enqueue_on(dev, op, [op, dev, flag, labels, m, poison] {
      const int32_t row = *flag.data<int32_t>();
      if (row == cuda::kNoBadRow) return;
      const int64_t label = labels.dtype() == DType::I64 ? labels.data<int64_t>()[row]
                                                         : labels.data<int32_t>()[row];
      fail_bad_row(op, dev, row, label, m, poison);
    }, flag, labels);
    return;
  }
  if constexpr (kGpuBuild) {
    // The flag is known once the stream has run: the check waits for the queue's next wait.
    enqueue_on(dev, op, [op, dev, flag, labels, m, poison] {
      queue_of(dev).defer_check([op, dev, flag, labels, m, poison] {
        int32_t row = cuda::kNoBadRow;
        gpu::read_to_host(dev.index, &row, flag.raw(), sizeof row);
        if (row == cuda::kNoBadRow) return;
        int64_t label = 0;
        if (labels.dtype() == DType::I64) {
          gpu::read_to_host(dev.index, &label, labels.data<int64_t>() + row, sizeof label);
        } else {
          int32_t narrow = 0;
          gpu::read_to_host(dev.index, &narrow, labels.data<int32_t>() + row, sizeof narrow);
          label = narrow;
        }
        fail_bad_row(op, dev, row, label, m, poison);
      });
    }, flag, labels);
  }
}

namespace cuda {

void check_bad_row(const char* op, int32_t bad_row_value, int64_t label, int64_t m) {
  if (bad_row_value == kNoBadRow) return;
  // cpu::softmax_ce_*'s wording (softmax_ce_cpu.cpp), so a user sees one message on any device.
  // Host code: CPU-only builds raise a flagged row through it too.
  throw std::out_of_range(std::string(op) + ": label " + std::to_string(label) + " in row " +
                          std::to_string(bad_row_value) + " is out of range for " +
                          std::to_string(m) + " classes; labels must be class indices in [0, " +
                          std::to_string(m) + ")");
}

}  // namespace cuda
}  // namespace mgpu::ops
