// cpp/ops/batch_norm_cpu.cpp -- batch norm's CPU kernels: x, y, dy, dx (N, C, HW), per-channel
// arrays (C,). The reductions read x once (shifted sums in double, one task per channel); forward
// and dx read and write each element once, in parallel over fixed blocks of (n, c) rows. Plain
// loops the compiler vectorises, compiled once per instruction-set path (cpu_isa.h); results
// never depend on the thread count, and both paths give the same bits.
#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "ops/batch_norm.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

// Double lanes per reduction: element i of a row goes to lane i % kLanes. Independent lanes let
// the compiler keep them in vector registers (a single accumulator is a serial chain), and 16
// hide the add latency at memory speed.
constexpr int kLanes = 16;
// Elements per parallel task in the per-element passes (fixed: no dependence on threads).
constexpr int64_t kTaskElements = 1 << 15;

double lane_sum(const double* lanes) {
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
}

// What a row's second stream is: none (the stats' sums of d, d^2 with d = x - shift), dy (the
// backward's sums of dy, dy * d with shift = mean), or dy masked by the saved ReLU output y (the
// fused layers' dz = dy where !(y <= 0), else 0: relu_backward's mask, NaN passing).
enum class Grad { kNone, kDy, kMaskedDy };

// Adds kLanes consecutive elements into the lanes a, b of a row's two sums. Written as
// whole-array steps, which GCC turns into vector code (a fused loop body it leaves scalar).
template <Grad kGrad>
inline void add_lanes(const float* __restrict xs, const float* __restrict gs,
                      const float* __restrict ys, double shift, double* __restrict a,
                      double* __restrict b) {
  double d[kLanes], g[kLanes], p[kLanes];
  float z[kLanes];
  for (int j = 0; j < kLanes; ++j) d[j] = static_cast<double>(xs[j]) - shift;
  if constexpr (kGrad == Grad::kMaskedDy) {
    for (int j = 0; j < kLanes; ++j) z[j] = !(ys[j] <= 0.0f) ? gs[j] : 0.0f;
  } else if constexpr (kGrad == Grad::kDy) {
    for (int j = 0; j < kLanes; ++j) z[j] = gs[j];
  }
  for (int j = 0; j < kLanes; ++j) g[j] = kGrad != Grad::kNone ? static_cast<double>(z[j]) : d[j];
  for (int j = 0; j < kLanes; ++j) p[j] = g[j] * d[j];
  for (int j = 0; j < kLanes; ++j) a[j] += g[j];
  for (int j = 0; j < kLanes; ++j) b[j] += p[j];
}

// One row (n, c, :): element i goes to lane i % kLanes of the row's own sums, which are then
// added into the channel's lanes s1, s2. The tail is padded with x = shift (and dy = 0), whose
// terms are exactly 0, so every step is a full block.
template <Grad kGrad>
void row_sums(const float* __restrict row, const float* __restrict dyrow,
              const float* __restrict yrow, int64_t HW, double shift, double* __restrict s1,
              double* __restrict s2) {
  constexpr bool kHasDy = kGrad != Grad::kNone, kHasY = kGrad == Grad::kMaskedDy;
  double a[kLanes] = {}, b[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= HW; i += kLanes) {
    add_lanes<kGrad>(row + i, kHasDy ? dyrow + i : nullptr, kHasY ? yrow + i : nullptr, shift, a,
                     b);
  }
  if (i < HW) {
    float xs[kLanes], gs[kLanes], ys[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      xs[j] = i + j < HW ? row[i + j] : static_cast<float>(shift);
      gs[j] = kHasDy && i + j < HW ? dyrow[i + j] : 0.0f;
      ys[j] = kHasY && i + j < HW ? yrow[i + j] : 0.0f;
    }
    add_lanes<kGrad>(xs, gs, ys, shift, a, b);
  }
  for (int j = 0; j < kLanes; ++j) {
    s1[j] += a[j];
    s2[j] += b[j];
  }
}

// Runs fn(first_plane, last_plane) over the N*C rows of HW elements in fixed blocks.
template <class F>
void for_plane_blocks(int64_t planes, int64_t HW, F&& fn) {
  const int64_t per_task = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(HW, 1));
  parallel_for((planes + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t first = task * per_task;
    fn(first, std::min(planes, first + per_task));
  });
}

float invstd_of(float var, float eps) { return 1.0f / std::sqrt(var + eps); }

}  // namespace

void batch_norm_stats(int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var) {
  const double count = static_cast<double>(N * HW);
  parallel_for(C, [&](int64_t c) {
    // Shifting by one of the channel's values keeps the sums small when mean >> std, so
    // S2 - S1^2 / count does not cancel away the variance.
    const double shift = x[c * HW];
    double s1[kLanes] = {}, s2[kLanes] = {};
    for (int64_t n = 0; n < N; ++n) {
      row_sums<Grad::kNone>(x + (n * C + c) * HW, nullptr, nullptr, HW, shift, s1, s2);
    }
    const double sum = lane_sum(s1), sum_sq = lane_sum(s2);
    mean[c] = static_cast<float>(shift + sum / count);
    var[c] = static_cast<float>(std::max(0.0, (sum_sq - sum * sum / count) / count));
  });
}

void batch_norm_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                        const float* var, const float* gamma, const float* beta, float eps,
                        float* y) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t c = p % C;
      const float invstd = invstd_of(var[c], eps);
      const float a = gamma ? gamma[c] * invstd : invstd, b = beta ? beta[c] : 0.0f;
      const float m = mean[c];
      const float* __restrict xp = x + p * HW;
      float* __restrict yp = y + p * HW;
      // x - mean first: with mean >> std, x * a + (b - mean * a) would cancel two large terms.
      for (int64_t i = 0; i < HW; ++i) yp[i] = (xp[i] - m) * a + b;
    }
  });
}

void batch_norm_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                                const float* mean, const float* var, float eps, float* sum_dy,
                                float* sum_dy_xhat) {
  parallel_for(C, [&](int64_t c) {
    double s1[kLanes] = {}, s2[kLanes] = {};
    const double m = mean[c];
    for (int64_t n = 0; n < N; ++n) {
      const int64_t at = (n * C + c) * HW;
      row_sums<Grad::kDy>(x + at, dy + at, nullptr, HW, m, s1, s2);
    }
    sum_dy[c] = static_cast<float>(lane_sum(s1));
    sum_dy_xhat[c] = static_cast<float>(lane_sum(s2) * invstd_of(var[c], eps));
  });
}

void batch_norm_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                         const float* mean, const float* var, const float* gamma,
                         const float* sum_dy, const float* sum_dy_xhat, double count, float eps,
                         bool training, float* dx) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t c = p % C;
      const float invstd = invstd_of(var[c], eps);
      const float k = gamma ? gamma[c] * invstd : invstd;
      const float* __restrict dyp = dy + p * HW;
      float* __restrict dxp = dx + p * HW;
      if (!training) {
        for (int64_t i = 0; i < HW; ++i) dxp[i] = k * dyp[i];
        continue;
      }
      // xhat * sum_dy_xhat / count = (x - mean) * coef, with invstd folded into coef.
      const float mean_dy = static_cast<float>(sum_dy[c] / count);
      const float coef = static_cast<float>(sum_dy_xhat[c] * static_cast<double>(invstd) / count);
      const float m = mean[c];
      const float* __restrict xp = x + p * HW;
      for (int64_t i = 0; i < HW; ++i) dxp[i] = k * (dyp[i] - mean_dy - (xp[i] - m) * coef);
    }
  });
}

// ---- batch norm + ReLU (+ residual add): the fused step's BatchNormRelu / BatchNormAddRelu ----

void batch_norm_act_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                            const float* var, const float* gamma, const float* beta,
                            const float* shortcut, float eps, float* y) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t c = p % C;
      const float invstd = invstd_of(var[c], eps);
      const float a = gamma ? gamma[c] * invstd : invstd, b = beta ? beta[c] : 0.0f;
      const float m = mean[c];
      const float* __restrict xp = x + p * HW;
      float* __restrict yp = y + p * HW;
      // batch_norm_forward's z, then the add, then relu's !(z <= 0) (NaN passes): the unfused
      // ops' rounding, one write of y instead of three passes.
      if (shortcut) {
        const float* __restrict sp = shortcut + p * HW;
        for (int64_t i = 0; i < HW; ++i) {
          const float z = (xp[i] - m) * a + b + sp[i];
          yp[i] = !(z <= 0.0f) ? z : 0.0f;
        }
      } else {
        for (int64_t i = 0; i < HW; ++i) {
          const float z = (xp[i] - m) * a + b;
          yp[i] = !(z <= 0.0f) ? z : 0.0f;
        }
      }
    }
  });
}

void batch_norm_act_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x,
                                    const float* y, const float* dy, const float* mean,
                                    const float* var, float eps, float* sum_dz,
                                    float* sum_dz_xhat) {
  parallel_for(C, [&](int64_t c) {
    double s1[kLanes] = {}, s2[kLanes] = {};
    const double m = mean[c];
    for (int64_t n = 0; n < N; ++n) {
      const int64_t at = (n * C + c) * HW;
      row_sums<Grad::kMaskedDy>(x + at, dy + at, y + at, HW, m, s1, s2);
    }
    sum_dz[c] = static_cast<float>(lane_sum(s1));
    sum_dz_xhat[c] = static_cast<float>(lane_sum(s2) * invstd_of(var[c], eps));
  });
}

void batch_norm_act_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* y,
                             const float* dy, const float* mean, const float* var,
                             const float* gamma, const float* sum_dz, const float* sum_dz_xhat,
                             double count, float eps, float* dx, float* dshortcut) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t c = p % C;
      const float invstd = invstd_of(var[c], eps);
      const float k = gamma ? gamma[c] * invstd : invstd;
      // batch_norm_backward's training formula with dz in place of dy.
      const float mean_dz = static_cast<float>(sum_dz[c] / count);
      const float coef = static_cast<float>(sum_dz_xhat[c] * static_cast<double>(invstd) / count);
      const float m = mean[c];
      const float* __restrict xp = x + p * HW;
      const float* __restrict yp = y + p * HW;
      const float* __restrict dyp = dy + p * HW;
      float* __restrict dxp = dx + p * HW;
      if (dshortcut) {
        float* __restrict dsp = dshortcut + p * HW;
        for (int64_t i = 0; i < HW; ++i) {
          const float g = dyp[i];
          const float dz = !(yp[i] <= 0.0f) ? g : 0.0f;
          dsp[i] = dz;
          dxp[i] = k * (dz - mean_dz - (xp[i] - m) * coef);
        }
      } else {
        for (int64_t i = 0; i < HW; ++i) {
          const float g = dyp[i];
          const float dz = !(yp[i] <= 0.0f) ? g : 0.0f;
          dxp[i] = k * (dz - mean_dz - (xp[i] - m) * coef);
        }
      }
    }
  });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
