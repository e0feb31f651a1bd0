// cpp/ops/argmax.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
#include "ops/argmax.h"

#include <vector>

#include "ops/dispatch.h"
#include "ops/softmax_ce.h"

namespace mgpu::ops {

Tensor argmax(const Tensor& x) {
  const char* op = "argmax";
  require_dtype(op, "x", x, DType::F32);
  MGPU_CHECK_VALUE(x.dim() == 1 || x.dim() == 2, op, ": x must have 1 or 2 dims, got shape ",
                   x.shape());
  MGPU_CHECK_VALUE(x.size(-1) > 0, op, ": the reduced axis is empty in shape ", x.shape());
  const int64_t rows = x.dim() == 2 ? x.size(0) : 1, m = x.size(-1);
  Tensor out = Tensor::empty(x.dim() == 2 ? Shape{rows} : Shape{}, DType::I64, x.device());
  const float* xp = x.f32();
  int64_t* outp = out.data<int64_t>();
  dispatch(x.device(), op, [=] { cpu::argmax_rows(rows, m, xp, outp); },
           [=](cudaStream_t stream) { cuda::argmax_rows(rows, m, xp, outp, stream); }, x, out);
  return out;
}

Tensor correct_count(const Tensor& logits, const Tensor& labels) {
  const char* op = "correct_count";
  check_logits_and_labels(op, logits, labels);
  Tensor out = Tensor::empty({}, DType::F32, logits.device());
  const int64_t n = logits.size(0), m = logits.size(1);
  const float* zp = logits.f32();
  float* cp = out.f32();
  auto count = [&](auto* yp) {
    dispatch(logits.device(), op,
             [=] {
               std::vector<int64_t> pred(static_cast<size_t>(n));
               cpu::argmax_rows(n, m, zp, pred.data());
               int64_t hits = 0;
               for (int64_t i = 0; i < n; ++i) hits += pred[i] == static_cast<int64_t>(yp[i]);
               *cp = static_cast<float>(hits);
             },
             [=](cudaStream_t stream) { cuda::correct_count(n, m, zp, yp, cp, stream); }, logits,
             labels, out);
  };
  if (labels.dtype() == DType::I64) count(labels.data<int64_t>());
  else count(labels.data<int32_t>());
  return out;
}

}  // namespace mgpu::ops
