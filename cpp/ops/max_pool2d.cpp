// cpp/ops/max_pool2d.cpp -- validate, allocate, dispatch to the CPU or CUDA kernels.
#include "ops/max_pool2d.h"

#include <limits>

#include "ops/dispatch.h"

namespace mgpu::ops {
namespace {

MaxPoolShape check_pool(const char* op, int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh,
                        int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  MGPU_CHECK_VALUE(kh >= 1 && kw >= 1, op, ": kernel_size must be >= 1, got (", kh, ", ", kw, ")");
  MGPU_CHECK_VALUE(sh >= 1 && sw >= 1, op, ": stride must be >= 1, got (", sh, ", ", sw, ")");
  MGPU_CHECK_VALUE(ph >= 0 && pw >= 0 && 2 * ph <= kh && 2 * pw <= kw, op,
                   ": padding must be >= 0 and at most half the kernel size, got padding (", ph,
                   ", ", pw, ") for kernel (", kh, ", ", kw, ")");
  MGPU_CHECK_VALUE(H + 2 * ph >= kh && W + 2 * pw >= kw, op, ": the ", kh, "x", kw,
                   " window is larger than the ", H, "x", W, " input padded by (", ph, ", ", pw,
                   ")");
  MGPU_CHECK_VALUE(H * W <= std::numeric_limits<int32_t>::max(), op, ": a ", H, "x", W,
                   " plane is too large for int32 indices");
  return {N, C, H, W, kh, kw, sh, sw, ph, pw};
}

}  // namespace

MaxPool2d max_pool2d_forward(const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                             int64_t ph, int64_t pw, bool keep_indices) {
  const char* op = "max_pool2d_forward";
  require_dtype(op, "x", x, DType::F32);
  MGPU_CHECK_VALUE(x.dim() == 4, op, ": x must have 4 dims (N, C, H, W), got shape ", x.shape());
  const MaxPoolShape s =
      check_pool(op, x.size(0), x.size(1), x.size(2), x.size(3), kh, kw, sh, sw, ph, pw);
  const Shape ys{s.N, s.C, s.P(), s.Q()};
  MaxPool2d out;
  out.y = Tensor::empty(ys, DType::F32, x.device(), op);
  if (keep_indices) out.indices = Tensor::empty(ys, DType::I32, x.device(), op);
  const float* xp = x.f32();
  float* yp = out.y.f32();
  int32_t* ip = keep_indices ? out.indices.data<int32_t>() : nullptr;
  dispatch(x.device(), op, [=] { cpu::max_pool2d_forward(s, xp, yp, ip); },
           [=](cudaStream_t stream) { cuda::max_pool2d_forward(s, xp, yp, ip, stream); }, x,
           out.y, out.indices);
  return out;
}

Tensor max_pool2d_backward(const Tensor& indices, const Tensor& dy, int64_t H, int64_t W,
                           int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                           int64_t pw) {
  const char* op = "max_pool2d_backward";
  require_dtype(op, "indices", indices, DType::I32);
  require_dtype(op, "dy", dy, DType::F32);
  require_same_device(op, {&indices, &dy});
  MGPU_CHECK_VALUE(dy.dim() == 4, op, ": dy must have 4 dims (N, C, P, Q), got shape ",
                   dy.shape());
  MGPU_CHECK_VALUE(indices.shape() == dy.shape(), op, ": indices have shape ", indices.shape(),
                   " but dy has shape ", dy.shape(), "; pass the indices forward returned");
  const MaxPoolShape s = check_pool(op, dy.size(0), dy.size(1), H, W, kh, kw, sh, sw, ph, pw);
  const Shape ys{s.N, s.C, s.P(), s.Q()};
  MGPU_CHECK_VALUE(dy.shape() == ys, op, ": dy must have the output's shape ", ys, ", got ",
                   dy.shape());
  Tensor dx = Tensor::empty({s.N, s.C, H, W}, DType::F32, dy.device(), op);
  const int32_t* ip = indices.data<int32_t>();
  const float* dyp = dy.f32();
  float* dxp = dx.f32();
  dispatch(dy.device(), op, [=] { cpu::max_pool2d_backward(s, ip, dyp, dxp); },
           [=](cudaStream_t stream) { cuda::max_pool2d_backward(s, ip, dyp, dxp, stream); },
           indices, dy, dx);
  return dx;
}

}  // namespace mgpu::ops
