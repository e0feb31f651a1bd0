// cpp/ops/conv2d.cpp -- validate, allocate, dispatch: the CPU kernels on CPU devices; on GPUs our
// CUDA kernels, or cuDNN when MGPU_CONV=cudnn (vendor_gpu.h).
#include "ops/conv2d.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/gpu.h"
#include "ops/bf16.h"
#include "ops/bf16_gpu.h"
#include "ops/dispatch.h"
#include "ops/vendor_gpu.h"

namespace mgpu::ops {
namespace {

Conv2dShape check_conv(const char* op, const Tensor& x, const Tensor& w, int64_t stride,
                            int64_t pad) {
  require_dtype(op, "x", x, DType::F32);
  require_dtype(op, "w", w, DType::F32);
  require_same_device(op, {&x, &w});
  MGPU_CHECK_VALUE(x.dim() == 4, op, ": x must have 4 dims (N, C, H, W), got shape ", x.shape(),
                   x.dim() == 2 ? "; add batch and channel axes, e.g. x.reshape(1, 1, H, W)"
                   : x.dim() == 3 ? "; add a batch axis, e.g. x.reshape(1, C, H, W)" : "");
  MGPU_CHECK_VALUE(w.dim() == 4, op, ": w must have 4 dims (K, C, R, S), got shape ", w.shape());
  MGPU_CHECK_VALUE(w.size(1) == x.size(1), op, ": x has ", x.size(1), " channels (shape ",
                   x.shape(), ") but w expects ", w.size(1), " (shape ", w.shape(), ")");
  MGPU_CHECK_VALUE(stride >= 1, op, ": stride must be >= 1, got ", stride);
  MGPU_CHECK_VALUE(pad >= 0, op, ": padding must be >= 0, got ", pad);
  // Keeps H + 2 * pad (and the output's extents) far from int64 overflow.
  MGPU_CHECK_VALUE(pad <= (int64_t{1} << 40), op, ": padding ", pad, " is too large (at most 2**40)");
  Conv2dShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
                     stride, pad};
  MGPU_CHECK_VALUE(x.size(2) + 2 * pad >= w.size(2) && x.size(3) + 2 * pad >= w.size(3), op,
                   ": the ", w.size(2), "x", w.size(3), " kernel is larger than the padded ",
                   x.size(2) + 2 * pad, "x", x.size(3) + 2 * pad, " image");
  return s;
}

}  // namespace

const char* conv_algo_name(ConvAlgo algo) {
  static const char* const kNames[] = {"auto", "tune", "direct", "im2col", "winograd"};
  return kNames[static_cast<int>(algo)];
}

namespace cpu {
ConvAlgo conv_algo() {
  // The last value seen and its parse, per thread (no lock on the conv's path).
  thread_local std::string last;
  thread_local ConvAlgo parsed = ConvAlgo::Auto;
  const char* env = std::getenv("MGPU_CONV_ALGO");
  const char* v = env ? env : "";
  if (v == last) return parsed;
  ConvAlgo algo = ConvAlgo::Auto;
  for (ConvAlgo a : {ConvAlgo::Auto, ConvAlgo::Tune, ConvAlgo::Direct, ConvAlgo::Im2col,
                     ConvAlgo::Winograd}) {
    if (std::strcmp(v, conv_algo_name(a)) == 0) algo = a;
  }
  MGPU_CHECK_VALUE(*v == '\0' || std::strcmp(v, conv_algo_name(algo)) == 0, "MGPU_CONV_ALGO=",
                   v, " is not understood; use auto (by the shape), tune (measure once per "
                   "shape), direct, im2col or winograd");
  parsed = algo;
  last = v;
  return parsed;
}
}  // namespace cpu

ConvAlgo conv_algo_for(Device d) { return d.is_cpu() ? cpu::conv_algo() : ConvAlgo::Auto; }

Tensor conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, int64_t stride,
                      int64_t pad, ConvAlgo algo, Precision precision) {
  const char* op = "conv2d_forward";
  Conv2dShape s = check_conv(op, x, w, stride, pad);
  if (b.defined()) {
    require_dtype(op, "b", b, DType::F32);
    require_same_device(op, {&x, &b});
    MGPU_CHECK_VALUE(b.dim() == 1 && b.size(0) == s.K, op, ": b must have shape (", s.K,
                     ",), one per output channel, got ", b.shape());
  }
  Tensor y = Tensor::empty({s.N, s.K, s.P(), s.Q()}, DType::F32, x.device(), op);
  const float *xp = x.f32(), *wp = w.f32(), *bp = b.defined() ? b.f32() : nullptr;
  float* yp = y.f32();
  const bool cudnn = !x.device().is_cpu() && conv_path() == ConvPath::Cudnn;
  const bool bf16 = precision == Precision::BF16, dot = bf16 && cpu::bf16_hardware_dot();
  dispatch(x.device(), op,
           [=] {
             if (bf16) {
               cpu::bf16_conv2d_forward(s, xp, wp, bp, yp, dot, algo);
             } else {
               cpu::conv2d_forward_algo(s, xp, wp, bp, yp, algo);
             }
           },
           [=, index = x.device().index](cudaStream_t stream) {
             if constexpr (kCudnn) {
               if (cudnn) {
                 cudnnContext* h = cuda::cudnn_handle(index);
                 if (bf16) {
                   GpuScratch ws(index, cuda::conv2d_cudnn_bf16_workspace_bytes(h, s));
                   cuda::conv2d_cudnn_bf16_forward(h, s, xp, wp, bp, yp, ws.ptr, ws.bytes);
                   return;
                 }
                 GpuScratch ws(index, cuda::conv2d_cudnn_workspace_bytes(h, s));
                 cuda::conv2d_cudnn_forward(h, s, xp, wp, bp, yp, ws.ptr, ws.bytes);
                 return;
               }
             }
             if (bf16) {
               cuda::bf16_conv2d_forward(s, xp, wp, bp, yp, stream);
               return;
             }
             cuda::conv2d_forward(s, xp, wp, bp, yp, stream);
           },
           x, w, b, y);
  return y;
}

Conv2dGrads conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, int64_t stride,
                            int64_t pad, bool need_dx, bool has_bias, ConvAlgo algo,
                            Precision precision) {
  const char* op = "conv2d_backward";
  Conv2dShape s = check_conv(op, x, w, stride, pad);
  require_dtype(op, "dy", dy, DType::F32);
  require_same_device(op, {&x, &dy});
  Shape want{s.N, s.K, s.P(), s.Q()};
  MGPU_CHECK_VALUE(dy.shape() == want, op, ": dy must have the output's shape ", want, ", got ",
                   dy.shape());
  Conv2dGrads g;
  if (need_dx) g.dx = Tensor::empty_like(x);
  g.dw = Tensor::empty_like(w);
  if (has_bias) g.db = Tensor::empty({s.K}, DType::F32, x.device());
  const float *xp = x.f32(), *wp = w.f32(), *dyp = dy.f32();
  float* dxp = need_dx ? g.dx.f32() : nullptr;
  float* dwp = g.dw.f32();
  float* dbp = has_bias ? g.db.f32() : nullptr;
  const bool cudnn = !x.device().is_cpu() && conv_path() == ConvPath::Cudnn;
  const bool bf16 = precision == Precision::BF16, dot = bf16 && cpu::bf16_hardware_dot();
  dispatch(x.device(), op,
           [=] {
             if (bf16) {
               cpu::bf16_conv2d_backward(s, xp, wp, dyp, dxp, dwp, dbp, dot, algo);
             } else {
               cpu::conv2d_backward_algo(s, xp, wp, dyp, dxp, dwp, dbp, algo);
             }
           },
           [=, index = x.device().index](cudaStream_t stream) {
             if constexpr (kCudnn) {
               if (cudnn) {
                 cudnnContext* h = cuda::cudnn_handle(index);
                 if (bf16) {
                   GpuScratch ws(index, cuda::conv2d_cudnn_bf16_workspace_bytes(h, s));
                   cuda::conv2d_cudnn_bf16_backward(h, s, xp, wp, dyp, dxp, dwp, dbp, ws.ptr,
                                                    ws.bytes);
                   return;
                 }
                 GpuScratch ws(index, cuda::conv2d_cudnn_workspace_bytes(h, s));
                 cuda::conv2d_cudnn_backward(h, s, xp, wp, dyp, dxp, dwp, dbp, ws.ptr, ws.bytes);
                 return;
               }
             }
             if (bf16) {
               cuda::bf16_conv2d_backward(s, xp, wp, dyp, dxp, dwp, dbp, stream);
               return;
             }
             cuda::conv2d_backward(s, xp, wp, dyp, dxp, dwp, dbp, stream);
           },
           x, w, dy, g.dx, g.dw, g.db);
  return g;
}

}  // namespace mgpu::ops
