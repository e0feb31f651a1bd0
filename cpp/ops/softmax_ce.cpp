// cpp/ops/softmax_ce.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
// On a GPU the labels are device memory, checked by the kernel: it flags the first bad row, and the
// queue reads the flag after the kernels finished (Queue::defer_check), raising the same
// IndexError the CPU raises at the next wait.
#include "ops/softmax_ce.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "core/gpu.h"
#include "ops/kernels_cpu.h"
#include "ops/launch.h"

namespace mgpu::ops {
namespace {

void check_ce(const char* op, const Tensor& logits, const Tensor& labels) {
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

// Calls fn with the labels' typed pointer.
template <typename Fn>
void with_labels(const Tensor& labels, Fn&& fn) {
  if (labels.dtype() == DType::I64) fn(labels.data<int64_t>());
  else fn(labels.data<int32_t>());
}

#if MGPU_GPU_BUILD
// Enqueues launch(labels, flag, stream) -- a kernel that flags the first bad label in `flag` --
// on the logits' GPU, then hands the queue the check that reads the flag after the kernel ran.
template <typename Launch, typename... Keep>
void enqueue_with_label_check(const char* op, const Tensor& logits, const Tensor& labels,
                              Launch launch, const Keep&... keep) {
  Tensor flag = Tensor::empty({}, DType::I32, logits.device());
  with_labels(labels, [&](auto* yp) {
    enqueue_gpu(logits.device(), op, [op, yp, launch, flag, labels, m = logits.size(1),
                                      dev = logits.device()](cudaStream_t stream) {
      launch(yp, flag.data<int32_t>(), stream);
      queue_of(dev).defer_check(LabelCheck{op, dev, flag, labels, m});
    }, keep...);
  });
}
#endif

}  // namespace

#if MGPU_GPU_BUILD
void LabelCheck::operator()() const {
  const int index = device.index;
  int32_t row = cuda::kNoBadRow;
  gpu::read_to_host(index, &row, flag.raw(), sizeof row);  // the queue has synchronised
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

LabelCheck LabelCheck::snapshot() const {
  LabelCheck copy{op, device, Tensor::empty_like(flag), Tensor::empty_like(labels), m};
  gpu::copy_within(device.index, copy.flag.raw(), flag.raw(), flag.nbytes());
  if (labels.nbytes())
    gpu::copy_within(device.index, copy.labels.raw(), labels.raw(), labels.nbytes());
  return copy;
}
#else
void LabelCheck::operator()() const {}
LabelCheck LabelCheck::snapshot() const { return *this; }
#endif

Tensor softmax_ce_forward(const Tensor& logits, const Tensor& labels) {
  const char* op = "cross_entropy";
  check_ce(op, logits, labels);
  Tensor loss = Tensor::empty({logits.size(0)}, DType::F32, logits.device(), op);
#if MGPU_GPU_BUILD
  if (!logits.device().is_cpu()) {
    enqueue_with_label_check(op, logits, labels,
        [n = logits.size(0), m = logits.size(1), zp = logits.f32(), lp = loss.f32()](
            auto* yp, int32_t* flag, cudaStream_t stream) {
          cuda::softmax_ce_forward(n, m, zp, yp, lp, flag, stream);
        }, logits, labels, loss);
    return loss;
  }
#endif
  with_labels(labels, [&](auto* yp) {
    enqueue_on(logits.device(), op,
               [n = logits.size(0), m = logits.size(1), zp = logits.f32(), yp, lp = loss.f32()] {
                 cpu::softmax_ce_forward(n, m, zp, yp, lp);
               }, logits, labels, loss);
  });
  return loss;
}

Tensor softmax_ce_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss) {
  const char* op = "cross_entropy_backward";
  check_ce(op, logits, labels);
  require_dtype(op, "dloss", dloss, DType::F32);
  require_same_device(op, {&logits, &dloss});
  MGPU_CHECK_VALUE(dloss.shape() == Shape{logits.size(0)}, op, ": dloss must have shape (",
                   logits.size(0), ",), got ", dloss.shape());
  Tensor dz = Tensor::empty_like(logits);
#if MGPU_GPU_BUILD
  if (!logits.device().is_cpu()) {
    enqueue_with_label_check(op, logits, labels,
        [n = logits.size(0), m = logits.size(1), zp = logits.f32(), dlp = dloss.f32(),
         dzp = dz.f32()](auto* yp, int32_t* flag, cudaStream_t stream) {
          cuda::softmax_ce_backward(n, m, zp, yp, dlp, dzp, flag, stream);
        }, logits, dloss, dz);
    return dz;
  }
#endif
  with_labels(labels, [&](auto* yp) {
    enqueue_on(logits.device(), op,
               [n = logits.size(0), m = logits.size(1), zp = logits.f32(), yp,
                dlp = dloss.f32(), dzp = dz.f32()] {
                 cpu::softmax_ce_backward(n, m, zp, yp, dlp, dzp);
               }, logits, labels, dloss, dz);
  });
  return dz;
}

Tensor argmax(const Tensor& x) {
  require_dtype("argmax", "x", x, DType::F32);
  MGPU_CHECK_VALUE(x.dim() == 1 || x.dim() == 2, "argmax: x must have 1 or 2 dims, got shape ",
                   x.shape());
  MGPU_CHECK_VALUE(x.size(-1) > 0, "argmax: the reduced axis is empty in shape ", x.shape());
  int64_t rows = x.dim() == 2 ? x.size(0) : 1;
  Tensor out = Tensor::empty(x.dim() == 2 ? Shape{rows} : Shape{}, DType::I64, x.device());
#if MGPU_GPU_BUILD
  if (!x.device().is_cpu()) {
    enqueue_gpu(x.device(), "argmax", [rows, m = x.size(-1), xp = x.f32(),
                                       op = out.data<int64_t>()](cudaStream_t stream) {
      cuda::argmax_rows(rows, m, xp, op, stream);
    }, x, out);
    return out;
  }
#endif
  enqueue_on(x.device(), "argmax", [rows, m = x.size(-1), xp = x.f32(), op = out.data<int64_t>()] {
    cpu::argmax_rows(rows, m, xp, op);
  }, x, out);
  return out;
}

Tensor correct_count(const Tensor& logits, const Tensor& labels) {
  const char* op = "correct_count";
  check_ce(op, logits, labels);
  Tensor out = Tensor::empty({}, DType::F32, logits.device());
#if MGPU_GPU_BUILD
  if (!logits.device().is_cpu()) {
    with_labels(labels, [&](auto* yp) {
      enqueue_gpu(logits.device(), op, [n = logits.size(0), m = logits.size(1),
                                        zp = logits.f32(), yp, cp = out.f32()](cudaStream_t s) {
        cuda::correct_count(n, m, zp, yp, cp, s);
      }, logits, labels, out);
    });
    return out;
  }
#endif
  with_labels(labels, [&](auto* yp) {
    enqueue_on(logits.device(), op,
               [n = logits.size(0), m = logits.size(1), zp = logits.f32(), yp, cp = out.f32()] {
                 std::vector<int64_t> pred(static_cast<size_t>(n));
                 cpu::argmax_rows(n, m, zp, pred.data());
                 int64_t hits = 0;
                 for (int64_t i = 0; i < n; ++i) hits += pred[i] == static_cast<int64_t>(yp[i]);
                 *cp = static_cast<float>(hits);
               }, logits, labels, out);
  });
  return out;
}

}  // namespace mgpu::ops
