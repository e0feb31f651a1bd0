// cpp/ops/conv2d_relu_pool.cpp -- validate, allocate and enqueue the fused CPU kernels; a GPU
// device raises (there the three ops run one by one).
#include "ops/conv2d_relu_pool.h"

#include <vector>

#include "ops/bf16.h"
#include "ops/dispatch.h"

namespace mgpu::ops {
namespace {

Conv2dShape check_fused(const char* op, const Tensor& x, const Tensor& w, int64_t stride,
                        int64_t pad, int64_t pool) {
  require_dtype(op, "x", x, DType::F32);
  require_dtype(op, "w", w, DType::F32);
  require_same_device(op, {&x, &w});
  MGPU_CHECK_VALUE(x.device().is_cpu(), op, ": runs on CPU devices only, got ", x.device(),
                   "; on a GPU use conv2d, relu and avg_pool2d");
  MGPU_CHECK_VALUE(x.dim() == 4 && w.dim() == 4 && w.size(1) == x.size(1), op,
                   ": x must be (N, C, H, W) and w (K, C, R, S), got ", x.shape(), " and ",
                   w.shape());
  MGPU_CHECK_VALUE(stride >= 1 && pad >= 0, op, ": stride must be >= 1 and padding >= 0, got ",
                   stride, " and ", pad);
  MGPU_CHECK_VALUE(x.size(2) + 2 * pad >= w.size(2) && x.size(3) + 2 * pad >= w.size(3), op,
                   ": the ", w.size(2), "x", w.size(3), " kernel is larger than the padded ",
                   x.size(2) + 2 * pad, "x", x.size(3) + 2 * pad, " image");
  Conv2dShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
                stride, pad};
  MGPU_CHECK_VALUE(pool >= 1 && pool <= s.P() && pool <= s.Q(), op, ": the pool size ", pool,
                   " must be in [1, ", s.P() < s.Q() ? s.P() : s.Q(), "] for the conv's ", s.P(),
                   "x", s.Q(), " output");
  return s;
}

// The calling thread's rounded copies (bf16): the kernels round x in their blocks.
thread_local std::vector<float> tl_w, tl_dpooled;

const float* rounded(const float* x, int64_t n, std::vector<float>& buf) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  cpu::bf16_round_floats(n, x, buf.data());
  return buf.data();
}

}  // namespace

bool conv2d_relu_pool_takes_bf16(const Tensor& x, const Tensor& w, int64_t pool, ConvAlgo algo) {
  if (!x.device().is_cpu() || x.dim() != 4 || w.dim() != 4 || pool < 1 || (pool & (pool - 1))) {
    return false;
  }
  const Conv2dShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
                      1, 0};
  return cpu::bf16_rounds_for_rule(s, algo);
}

Conv2dReluPool conv2d_relu_pool_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                        int64_t stride, int64_t pad, int64_t pool,
                                        bool keep_mask, Precision precision) {
  const char* op = "conv2d_relu_pool_forward";
  const Conv2dShape s = check_fused(op, x, w, stride, pad, pool);
  require_dtype(op, "b", b, DType::F32);
  require_same_device(op, {&x, &b});
  MGPU_CHECK_VALUE(b.dim() == 1 && b.size(0) == s.K, op, ": b must have shape (", s.K,
                   ",), one per output channel, got ", b.shape());
  Conv2dReluPool out;
  if (keep_mask) out.mask = Tensor::empty({s.N, s.K, s.P(), s.Q()}, DType::U8, x.device());
  out.pooled = Tensor::empty({s.N, s.K, s.P() / pool, s.Q() / pool}, DType::F32, x.device());
  enqueue_on(x.device(), op,
             [s, pool, xp = x.f32(), wp = w.f32(), bp = b.f32(),
              mp = keep_mask ? out.mask.data<uint8_t>() : nullptr, pp = out.pooled.f32(),
              bf16 = precision == Precision::BF16,
              dot = precision == Precision::BF16 && cpu::bf16_hardware_dot()] {
               const float* wr = bf16 ? rounded(wp, s.K * s.C * s.R * s.S, tl_w) : wp;
               cpu::conv2d_relu_pool_forward(s, pool, xp, wr, bp, mp, pp, bf16, dot);
             },
             x, w, b, out.mask, out.pooled);
  return out;
}

Conv2dGrads conv2d_relu_pool_backward(const Tensor& x, const Tensor& w, const Tensor& mask,
                                      const Tensor& dpooled, int64_t stride, int64_t pad,
                                      int64_t pool, bool need_dx, Precision precision) {
  const char* op = "conv2d_relu_pool_backward";
  const Conv2dShape s = check_fused(op, x, w, stride, pad, pool);
  MGPU_CHECK_TYPE(mask.dtype() == DType::U8, op, ": mask must be uint8, got ",
                  dtype_name(mask.dtype()));
  require_dtype(op, "dpooled", dpooled, DType::F32);
  require_same_device(op, {&x, &mask, &dpooled});
  const Shape want_mask{s.N, s.K, s.P(), s.Q()}, want_dp{s.N, s.K, s.P() / pool, s.Q() / pool};
  MGPU_CHECK_VALUE(mask.shape() == want_mask, op, ": mask must have shape ", want_mask, ", got ",
                   mask.shape());
  MGPU_CHECK_VALUE(dpooled.shape() == want_dp, op, ": dpooled must have shape ", want_dp,
                   ", got ", dpooled.shape());
  Conv2dGrads g;
  if (need_dx) g.dx = Tensor::empty_like(x);
  g.dw = Tensor::empty_like(w);
  g.db = Tensor::empty({s.K}, DType::F32, x.device());
  enqueue_on(x.device(), op,
             [s, pool, xp = x.f32(), wp = w.f32(), mp = mask.data<uint8_t>(), dp = dpooled.f32(),
              dxp = need_dx ? g.dx.f32() : nullptr, dwp = g.dw.f32(), dbp = g.db.f32(),
              bf16 = precision == Precision::BF16,
              dot = precision == Precision::BF16 && cpu::bf16_hardware_dot()] {
               if (!bf16) return cpu::conv2d_relu_pool_backward(s, pool, xp, wp, mp, dp, dxp, dwp,
                                                                dbp, false, false);
               const int64_t pooled = s.N * s.K * (s.P() / pool) * (s.Q() / pool);
               cpu::conv2d_relu_pool_backward(s, pool, xp, rounded(wp, s.K * s.C * s.R * s.S, tl_w),
                                              mp, rounded(dp, pooled, tl_dpooled), dxp, dwp, dbp,
                                              true, dot);
             },
             x, w, mask, dpooled, g.dx, g.dw, g.db);
  return g;
}

}  // namespace mgpu::ops
