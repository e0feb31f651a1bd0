// cpp/ops/avg_pool2d.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
#include "ops/avg_pool2d.h"

#include "ops/dispatch.h"

namespace mgpu::ops {
namespace {

Shape check_pool(const char* op, const Tensor& x, int64_t kh, int64_t kw, int64_t sh,
                 int64_t sw) {
  require_dtype(op, "x", x, DType::F32);
  MGPU_CHECK_VALUE(x.dim() == 4, op, ": x must have 4 dims (N, C, H, W), got shape ", x.shape());
  MGPU_CHECK_VALUE(kh >= 1 && kw >= 1, op, ": kernel_size must be >= 1, got (", kh, ", ", kw, ")");
  MGPU_CHECK_VALUE(sh >= 1 && sw >= 1, op, ": stride must be >= 1, got (", sh, ", ", sw, ")");
  MGPU_CHECK_VALUE(kh <= x.size(2) && kw <= x.size(3), op, ": the ", kh, "x", kw,
                   " window is larger than the ", x.size(2), "x", x.size(3), " input");
  return {x.size(0), x.size(1), (x.size(2) - kh) / sh + 1, (x.size(3) - kw) / sw + 1};
}

}  // namespace

Tensor avg_pool2d_forward(const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
  const char* op = "avg_pool2d_forward";
  Shape ys = check_pool(op, x, kh, kw, sh, sw);
  Tensor y = Tensor::empty(ys, DType::F32, x.device(), op);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const float* xp = x.f32();
  float* yp = y.f32();
  dispatch(x.device(), op,
           [=] { cpu::avg_pool2d_forward(N, C, H, W, kh, kw, sh, sw, xp, yp); },
           [=](cudaStream_t s) { cuda::avg_pool2d_forward(N, C, H, W, kh, kw, sh, sw, xp, yp, s); },
           x, y);
  return y;
}

Tensor avg_pool2d_backward(const Tensor& x, const Tensor& dy, int64_t kh, int64_t kw,
                           int64_t sh, int64_t sw) {
  const char* op = "avg_pool2d_backward";
  Shape ys = check_pool(op, x, kh, kw, sh, sw);
  require_dtype(op, "dy", dy, DType::F32);
  require_same_device(op, {&x, &dy});
  MGPU_CHECK_VALUE(dy.shape() == ys, op, ": dy must have the output's shape ", ys, ", got ",
                   dy.shape());
  Tensor dx = Tensor::empty_like(x);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const float* dyp = dy.f32();
  float* dxp = dx.f32();
  dispatch(x.device(), op,
           [=] { cpu::avg_pool2d_backward(N, C, H, W, kh, kw, sh, sw, dyp, dxp); },
           [=](cudaStream_t s) {
             cuda::avg_pool2d_backward(N, C, H, W, kh, kw, sh, sw, dyp, dxp, s);
           },
           dy, dx);
  return dx;
}

}  // namespace mgpu::ops
