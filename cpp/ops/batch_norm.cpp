// cpp/ops/batch_norm.cpp -- batch norm's checks, allocation and dispatch to the cpu:: or cuda::
// kernels of batch_norm.h. x (N, C, H, W) or (N, C); per-channel tensors (C,).
#include "ops/batch_norm.h"

#include <cmath>
#include <tuple>

#include "ops/dispatch.h"
#include "ops/elementwise.h"

namespace mgpu::ops {
namespace {

struct BnShape {
  int64_t N, C, HW;
};

BnShape check_x(const char* op, const Tensor& x) {
  require_dtype(op, "x", x, DType::F32);
  MGPU_CHECK_VALUE(x.dim() == 4 || x.dim() == 2, op,
                   ": x must have 4 dims (N, C, H, W) or 2 dims (N, C), got shape ", x.shape(),
                   x.dim() == 3 ? "; add a batch axis, e.g. x.reshape(1, C, H, W)" : "");
  return {x.size(0), x.size(1), x.dim() == 4 ? x.size(2) * x.size(3) : 1};
}

void check_channel(const char* op, const char* name, const Tensor& t, const Tensor& x) {
  require_dtype(op, name, t, DType::F32);
  require_same_device(op, {&x, &t});
  MGPU_CHECK_VALUE(t.dim() == 1 && t.size(0) == x.size(1), op, ": ", name, " must have shape (",
                   x.size(1), ",) (one value per channel of x, shape ", x.shape(), "), got shape ",
                   t.shape());
}

void check_eps(const char* op, float eps) {
  MGPU_CHECK_VALUE(eps > 0.0f && std::isfinite(eps), op, ": eps must be a positive number, got ",
                   eps);
}

// What normalising x reads: mean and var, gamma and beta where given (one value per channel of x,
// on x's device), and eps.
void check_stats(const char* op, const Tensor& x, const Tensor& mean, const Tensor& var,
                 const Tensor* gamma, const Tensor* beta, float eps) {
  check_channel(op, "mean", mean, x);
  check_channel(op, "var", var, x);
  if (gamma) check_channel(op, "weight (gamma)", *gamma, x);
  if (beta) check_channel(op, "bias (beta)", *beta, x);
  check_eps(op, eps);
}

// What a backward's dx reads beyond check_stats: the two per-channel sums (named as the op names
// them) and the count of elements per channel behind the statistics.
void check_sums(const char* op, const Tensor& x, const char* name, const Tensor& sum,
                const char* name_xhat, const Tensor& sum_xhat, double count) {
  check_channel(op, name, sum, x);
  check_channel(op, name_xhat, sum_xhat, x);
  MGPU_CHECK_VALUE(count > 0.0 && std::isfinite(count), op,
                   ": count (elements per channel behind the statistics) must be > 0, got ",
                   count);
}

// x and another tensor of x's shape on x's device (dy, y, the shortcut).
void check_like_x(const char* op, const char* name, const Tensor& t, const Tensor& x) {
  require_dtype(op, name, t, DType::F32);
  require_same_device(op, {&x, &t});
  MGPU_CHECK_VALUE(t.shape() == x.shape(), op, ": ", name, " has shape ", t.shape(),
                   " but x has shape ", x.shape(), "; they must match");
}

// The fused batch norm + relu (+ add) ops are one CPU kernel each: the fused step's Model runs
// the ops one by one on GPUs (model.h).
void require_cpu_act(const char* op, const Tensor& x) {
  MGPU_CHECK_VALUE(x.device().is_cpu(), op, ": CPU devices only, got x on ", x.device(),
                   "; on a GPU run batch_norm_forward, the add and relu one after another");
}

// A fused op's backward inputs: x, its output y and dy, all of x's shape on x's CPU device.
BnShape check_act_backward_args(const char* op, const Tensor& x, const Tensor& y,
                                const Tensor& dy) {
  const BnShape s = check_x(op, x);
  check_like_x(op, "y", y, x);
  check_like_x(op, "dy", dy, x);
  require_cpu_act(op, x);
  return s;
}

void check_count(const char* op, const BnShape& s) {
  MGPU_CHECK_VALUE(s.N * s.HW >= 1, op, ": x has no elements per channel (N*H*W = 0), so it has "
                   "no statistics; pass a non-empty batch");
}

const float* ptr(const Tensor* t) { return t ? t->f32() : nullptr; }

// Device scratch for the CUDA reductions' chunk partials, kept alive by the enqueued task; none
// on a CPU device.
Tensor reduction_workspace(const BnShape& s, Device device) {
  if constexpr (kGpuBuild) {
    if (!device.is_cpu()) {
      const size_t bytes = cuda::batch_norm_workspace_bytes(s.N, s.C, s.HW);
      return Tensor::empty({static_cast<int64_t>(bytes / sizeof(float))}, DType::F32, device);
    }
  }
  return Tensor();
}

}  // namespace

std::pair<Tensor, Tensor> batch_norm_stats(const Tensor& x) {
  const char* op = "batch_norm_stats";
  const BnShape s = check_x(op, x);
  check_count(op, s);
  Tensor mean = Tensor::empty({s.C}, DType::F32, x.device());
  Tensor var = Tensor::empty({s.C}, DType::F32, x.device());
  Tensor ws = reduction_workspace(s, x.device());
  const float* xp = x.f32();
  float *mp = mean.f32(), *vp = var.f32();
  dispatch(x.device(), op, [=] { cpu::batch_norm_stats(s.N, s.C, s.HW, xp, mp, vp); },
           [=, wp = ws.defined() ? ws.raw() : nullptr](cudaStream_t st) {
             cuda::batch_norm_stats(s.N, s.C, s.HW, xp, mp, vp, wp, st);
           },
           x, mean, var, ws);
  return {mean, var};
}

Tensor batch_norm_forward(const Tensor& x, const Tensor& mean, const Tensor& var,
                          const Tensor* gamma, const Tensor* beta, float eps) {
  const char* op = "batch_norm_forward";
  const BnShape s = check_x(op, x);
  check_stats(op, x, mean, var, gamma, beta, eps);
  Tensor y = Tensor::empty_like(x);
  const Tensor none;
  const Tensor& g = gamma ? *gamma : none;
  const Tensor& b = beta ? *beta : none;
  auto run = [s, xp = x.f32(), mp = mean.f32(), vp = var.f32(), gp = ptr(gamma), bp = ptr(beta),
              eps, yp = y.f32()](auto&&... stream) {
    if constexpr (sizeof...(stream) == 0) {
      cpu::batch_norm_forward(s.N, s.C, s.HW, xp, mp, vp, gp, bp, eps, yp);
    } else {
      cuda::batch_norm_forward(s.N, s.C, s.HW, xp, mp, vp, gp, bp, eps, yp, stream...);
    }
  };
  // Undefined tensors in the keep list are harmless: they hold no storage.
  dispatch(x.device(), op, [run] { run(); }, [run](cudaStream_t st) { run(st); }, x, mean, var, g,
           b, y);
  return y;
}

std::pair<Tensor, Tensor> batch_norm_backward_reduce(const Tensor& x, const Tensor& dy,
                                                     const Tensor& mean, const Tensor& var,
                                                     float eps) {
  const char* op = "batch_norm_backward_reduce";
  const BnShape s = check_x(op, x);
  check_like_x(op, "dy", dy, x);
  check_stats(op, x, mean, var, nullptr, nullptr, eps);
  check_count(op, s);
  Tensor sum_dy = Tensor::empty({s.C}, DType::F32, x.device());
  Tensor sum_dy_xhat = Tensor::empty({s.C}, DType::F32, x.device());
  Tensor ws = reduction_workspace(s, x.device());
  const float *xp = x.f32(), *dyp = dy.f32(), *mp = mean.f32(), *vp = var.f32();
  float *a = sum_dy.f32(), *b = sum_dy_xhat.f32();
  dispatch(x.device(), op,
           [=] { cpu::batch_norm_backward_reduce(s.N, s.C, s.HW, xp, dyp, mp, vp, eps, a, b); },
           [=, wp = ws.defined() ? ws.raw() : nullptr](cudaStream_t st) {
             cuda::batch_norm_backward_reduce(s.N, s.C, s.HW, xp, dyp, mp, vp, eps, a, b, wp, st);
           },
           x, dy, mean, var, sum_dy, sum_dy_xhat, ws);
  return {sum_dy, sum_dy_xhat};
}

Tensor batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& mean,
                           const Tensor& var, const Tensor* gamma, const Tensor& sum_dy,
                           const Tensor& sum_dy_xhat, double count, float eps, bool training) {
  const char* op = "batch_norm_backward";
  const BnShape s = check_x(op, x);
  check_like_x(op, "dy", dy, x);
  check_stats(op, x, mean, var, gamma, nullptr, eps);
  check_sums(op, x, "sum_dy", sum_dy, "sum_dy_xhat", sum_dy_xhat, count);
  Tensor dx = Tensor::empty_like(x);
  const Tensor none;
  const Tensor& g = gamma ? *gamma : none;
  auto run = [s, xp = x.f32(), dyp = dy.f32(), mp = mean.f32(), vp = var.f32(), gp = ptr(gamma),
              a = sum_dy.f32(), b = sum_dy_xhat.f32(), count, eps, training,
              dxp = dx.f32()](auto&&... stream) {
    if constexpr (sizeof...(stream) == 0) {
      cpu::batch_norm_backward(s.N, s.C, s.HW, xp, dyp, mp, vp, gp, a, b, count, eps, training,
                               dxp);
    } else {
      cuda::batch_norm_backward(s.N, s.C, s.HW, xp, dyp, mp, vp, gp, a, b, count, eps, training,
                                dxp, stream...);
    }
  };
  dispatch(x.device(), op, [run] { run(); }, [run](cudaStream_t st) { run(st); }, x, dy, mean, var,
           g, sum_dy, sum_dy_xhat, dx);
  return dx;
}

Tensor batch_norm_act_forward(const Tensor& x, const Tensor& mean, const Tensor& var,
                              const Tensor* gamma, const Tensor* beta, const Tensor* shortcut,
                              float eps) {
  const char* op = "batch_norm_act_forward";
  const BnShape s = check_x(op, x);
  if (shortcut) check_like_x(op, "shortcut", *shortcut, x);
  require_cpu_act(op, x);
  check_stats(op, x, mean, var, gamma, beta, eps);
  Tensor y = Tensor::empty_like(x);
  const Tensor none;
  dispatch(x.device(), op,
           [s, xp = x.f32(), mp = mean.f32(), vp = var.f32(), gp = ptr(gamma), bp = ptr(beta),
            sp = ptr(shortcut), eps, yp = y.f32()] {
             cpu::batch_norm_act_forward(s.N, s.C, s.HW, xp, mp, vp, gp, bp, sp, eps, yp);
           },
           [](cudaStream_t) { MGPU_ASSERT(false, "batch_norm_act_forward: CPU only"); }, x, mean,
           var, gamma ? *gamma : none, beta ? *beta : none, shortcut ? *shortcut : none, y);
  return y;
}

std::pair<Tensor, Tensor> batch_norm_act_backward_reduce(const Tensor& x, const Tensor& y,
                                                         const Tensor& dy, const Tensor& mean,
                                                         const Tensor& var, float eps) {
  const char* op = "batch_norm_act_backward_reduce";
  const BnShape s = check_act_backward_args(op, x, y, dy);
  check_stats(op, x, mean, var, nullptr, nullptr, eps);
  check_count(op, s);
  Tensor sum_dz = Tensor::empty({s.C}, DType::F32, x.device());
  Tensor sum_dz_xhat = Tensor::empty({s.C}, DType::F32, x.device());
  dispatch(x.device(), op,
           [s, xp = x.f32(), yp = y.f32(), dyp = dy.f32(), mp = mean.f32(), vp = var.f32(), eps,
            a = sum_dz.f32(), b = sum_dz_xhat.f32()] {
             cpu::batch_norm_act_backward_reduce(s.N, s.C, s.HW, xp, yp, dyp, mp, vp, eps, a, b);
           },
           [](cudaStream_t) { MGPU_ASSERT(false, "batch_norm_act_backward_reduce: CPU only"); },
           x, y, dy, mean, var, sum_dz, sum_dz_xhat);
  return {sum_dz, sum_dz_xhat};
}

std::pair<Tensor, Tensor> batch_norm_act_backward(const Tensor& x, const Tensor& y,
                                                  const Tensor& dy, const Tensor& mean,
                                                  const Tensor& var, const Tensor* gamma,
                                                  const Tensor& sum_dz, const Tensor& sum_dz_xhat,
                                                  double count, float eps, bool want_dshortcut) {
  const char* op = "batch_norm_act_backward";
  const BnShape s = check_act_backward_args(op, x, y, dy);
  check_stats(op, x, mean, var, gamma, nullptr, eps);
  check_sums(op, x, "sum_dz", sum_dz, "sum_dz_xhat", sum_dz_xhat, count);
  Tensor dx = Tensor::empty_like(x);
  Tensor dsc = want_dshortcut ? Tensor::empty_like(x) : Tensor();
  const Tensor none;
  dispatch(x.device(), op,
           [s, xp = x.f32(), yp = y.f32(), dyp = dy.f32(), mp = mean.f32(), vp = var.f32(),
            gp = ptr(gamma), a = sum_dz.f32(), b = sum_dz_xhat.f32(), count, eps,
            dxp = dx.f32(), dsp = dsc.defined() ? dsc.f32() : nullptr] {
             cpu::batch_norm_act_backward(s.N, s.C, s.HW, xp, yp, dyp, mp, vp, gp, a, b, count,
                                          eps, dxp, dsp);
           },
           [](cudaStream_t) { MGPU_ASSERT(false, "batch_norm_act_backward: CPU only"); }, x, y,
           dy, mean, var, gamma ? *gamma : none, sum_dz, sum_dz_xhat, dx, dsc);
  return {dx, dsc};
}

BatchNormGrads batch_norm_backward_full(const Tensor& x, const Tensor* y, const Tensor& dy,
                                        const Tensor& mean, const Tensor& var,
                                        const Tensor* gamma, float eps, bool want_dx,
                                        bool want_dshortcut) {
  const char* op = "batch_norm_backward_full";
  const BnShape s = check_x(op, x);
  if (y) check_like_x(op, "y", *y, x);
  check_like_x(op, "dy", dy, x);
  MGPU_CHECK_VALUE(y || !want_dshortcut, op, ": the shortcut's gradient needs y (the saved relu "
                   "output)");
  check_count(op, s);
  const double count = static_cast<double>(s.N * s.HW);
  if (!x.device().is_cpu()) {
    // The relu's part (y) is the fused layers' (CPU only); a GPU runs the two ops.
    MGPU_CHECK_VALUE(!y, op, ": with y (the fused relu) CPU devices only, got x on ", x.device(),
                     "; on a GPU run relu_backward, then this op without y");
    BatchNormGrads g;
    std::tie(g.sum_dy, g.sum_dy_xhat) = batch_norm_backward_reduce(x, dy, mean, var, eps);
    if (want_dx) {
      g.dx = batch_norm_backward(x, dy, mean, var, gamma, g.sum_dy, g.sum_dy_xhat, count, eps,
                                 true);
    }
    return g;
  }
  check_stats(op, x, mean, var, gamma, nullptr, eps);
  BatchNormGrads g;
  g.sum_dy = Tensor::empty({s.C}, DType::F32, x.device());
  g.sum_dy_xhat = Tensor::empty({s.C}, DType::F32, x.device());
  if (want_dx) g.dx = Tensor::empty_like(x);
  if (want_dshortcut) g.dshortcut = Tensor::empty_like(x);
  const Tensor none;
  // Without dx the shortcut's gradient comes from the dx loop all the same: dx goes to scratch.
  Tensor dx_buf = want_dx || !want_dshortcut ? g.dx : Tensor::empty_like(x);
  dispatch(x.device(), op,
           [s, xp = x.f32(), yp = ptr(y), dyp = dy.f32(), mp = mean.f32(), vp = var.f32(),
            gp = ptr(gamma), eps, a = g.sum_dy.f32(), b = g.sum_dy_xhat.f32(),
            dxp = dx_buf.defined() ? dx_buf.f32() : nullptr,
            dsp = want_dshortcut ? g.dshortcut.f32() : nullptr] {
             cpu::batch_norm_backward_full(s.N, s.C, s.HW, xp, yp, dyp, mp, vp, gp, eps, a, b,
                                           dxp, dsp);
           },
           [](cudaStream_t) { MGPU_ASSERT(false, "batch_norm_backward_full: CPU only"); }, x,
           y ? *y : none, dy, mean, var, gamma ? *gamma : none, g.sum_dy, g.sum_dy_xhat, dx_buf,
           g.dshortcut);
  return g;
}

void batch_norm_update_running(const Tensor& running, const Tensor& batch, float keep,
                               float step) {
  binary_scalar_inplace(BinaryOp::Mul, running, keep);
  binary_inplace(BinaryOp::Add, running, binary_scalar(BinaryOp::Mul, batch, step, false));
}

std::pair<Tensor, Tensor> batch_norm_combine_stats(const Tensor& parts) {
  const char* op = "batch_norm_combine_stats";
  require_dtype(op, "parts", parts, DType::F32);
  MGPU_CHECK_VALUE(parts.dim() == 2 && parts.size(1) % 2 == 1, op, ": parts must have shape "
                   "(K, 1 + 2C), got ", parts.shape());
  const int64_t K = parts.size(0), C = (parts.size(1) - 1) / 2;
  Tensor mean = Tensor::empty({C}, DType::F32, parts.device());
  Tensor var = Tensor::empty({C}, DType::F32, parts.device());
  for_each_index(op, parts.device(), C,
                 BatchNormCombineStats{parts.f32(), K, C, mean.f32(), var.f32()}, parts, mean,
                 var);
  return {mean, var};
}

std::pair<Tensor, Tensor> batch_norm_combine_stats(const std::vector<Tensor>& means,
                                                   const std::vector<Tensor>& vars,
                                                   const std::vector<double>& counts, Device at) {
  const char* op = "batch_norm_combine_stats";
  MGPU_CHECK_VALUE(!means.empty() && vars.size() == means.size() && counts.size() == means.size(),
                   op, ": one mean, one variance and one count per replica, got ", means.size(),
                   ", ", vars.size(), " and ", counts.size());
  const int64_t K = static_cast<int64_t>(means.size()), C = means[0].numel(), w = 1 + 2 * C;
  for (int64_t k = 0; k < K; ++k) {
    require_dtype(op, "mean", means[k], DType::F32);
    require_dtype(op, "var", vars[k], DType::F32);
    MGPU_CHECK_VALUE(means[k].numel() == C && vars[k].numel() == C, op, ": replica ", k,
                     " has ", means[k].numel(), " means and ", vars[k].numel(),
                     " variances, replica 0 has ", C);
  }
  Tensor parts = Tensor::empty({K, w}, DType::F32, at);
  fill(parts, 0.0);
  const Tensor flat = parts.reshape({K * w});
  for (int64_t k = 0; k < K; ++k) {
    if (counts[static_cast<size_t>(k)] == 0.0) continue;
    fill(flat.slice_rows(k * w, k * w + 1), counts[static_cast<size_t>(k)]);
    copy(flat.slice_rows(k * w + 1, k * w + 1 + C), means[static_cast<size_t>(k)]);
    copy(flat.slice_rows(k * w + 1 + C, (k + 1) * w), vars[static_cast<size_t>(k)]);
  }
  return batch_norm_combine_stats(parts);
}

std::pair<Tensor, Tensor> batch_norm_combine_sums(const Tensor& parts) {
  const char* op = "batch_norm_combine_sums";
  require_dtype(op, "parts", parts, DType::F32);
  MGPU_CHECK_VALUE(parts.dim() == 2 && parts.size(1) % 2 == 0, op, ": parts must have shape "
                   "(K, 2C), got ", parts.shape());
  const int64_t K = parts.size(0), C = parts.size(1) / 2;
  Tensor out = Tensor::empty({2 * C}, DType::F32, parts.device());
  for_each_index(op, parts.device(), 2 * C, BatchNormCombineSums{parts.f32(), K, C, out.f32()},
                 parts, out);
  return {out.slice_rows(0, C), out.slice_rows(C, 2 * C)};
}

std::pair<Tensor, Tensor> batch_norm_combine_sums(const std::vector<Tensor>& sum_dys,
                                                  const std::vector<Tensor>& sum_dy_xhats,
                                                  Device at) {
  const char* op = "batch_norm_combine_sums";
  MGPU_CHECK_VALUE(!sum_dys.empty() && sum_dy_xhats.size() == sum_dys.size(), op,
                   ": one sum_dy and one sum_dy_xhat per replica, got ", sum_dys.size(), " and ",
                   sum_dy_xhats.size());
  const int64_t K = static_cast<int64_t>(sum_dys.size()), C = sum_dys[0].numel(), w = 2 * C;
  for (int64_t k = 0; k < K; ++k) {
    const size_t i = static_cast<size_t>(k);
    require_dtype(op, "sum_dy", sum_dys[i], DType::F32);
    require_dtype(op, "sum_dy_xhat", sum_dy_xhats[i], DType::F32);
    MGPU_CHECK_VALUE(sum_dys[i].numel() == C && sum_dy_xhats[i].numel() == C, op, ": replica ",
                     k, " has ", sum_dys[i].numel(), " and ", sum_dy_xhats[i].numel(),
                     " sums, replica 0 has ", C);
  }
  const Tensor parts = Tensor::empty({K, w}, DType::F32, at);
  const Tensor flat = parts.reshape({K * w});
  for (int64_t k = 0; k < K; ++k) {
    copy(flat.slice_rows(k * w, k * w + C), sum_dys[static_cast<size_t>(k)]);
    copy(flat.slice_rows(k * w + C, (k + 1) * w), sum_dy_xhats[static_cast<size_t>(k)]);
  }
  return batch_norm_combine_sums(parts);
}

}  // namespace mgpu::ops
