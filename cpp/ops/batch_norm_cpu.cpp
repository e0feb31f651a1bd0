// cpp/ops/batch_norm_cpu.cpp -- batch norm's CPU kernels: x, y, dy, dx (N, C, HW), per-channel
// arrays (C,). The reductions read their inputs once (shifted sums in double, in parallel over
// fixed groups of channels); forward and dx read and write each element once, in parallel over
// fixed blocks of (n, c) rows. The reductions use explicit vectors (GCC vector extensions),
// compiled once per instruction-set path (cpu_isa.h); each of their 16 lanes does the same
// operations on both paths, so both give the same bits, and results never depend on the thread
// count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "ops/batch_norm.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

// Double lanes per reduction: element i of a row goes to lane i % kLanes. Independent lanes keep
// the sums in vector registers (a single accumulator is a serial chain), and 16 hide the add
// latency at memory speed.
constexpr int kLanes = 16;
// Elements per parallel task in the per-element passes (fixed: no dependence on threads).
constexpr int64_t kTaskElements = 1 << 15;
// Elements per row-run a reduction task aims for: a task takes a group of neighbouring channels
// and walks n outermost, so it reads runs of (channels in the group) * HW contiguous floats per
// stream (a single channel's rows are only HW floats: 64 bytes at 4x4, which defeats the
// prefetchers). Each channel's order of summation stays the same whatever the group.
constexpr int64_t kRunElements = 2048;
// Bytes of input a task of batch_norm_backward_full aims to hold: its dx loop re-reads what its
// sums just read, from L2 (1 MB per core on Zen 4) or L3 rather than memory.
constexpr int64_t kReuseBytes = 1 << 20;

// The 16 lanes as kUnits native vectors of kWidth doubles: zmm registers with AVX-512, ymm with
// AVX2 (a 16-double vector type would be wider than either, and GCC lowers its conversions
// element by element). Each lane does the same operations on both paths.
#if defined(__AVX512F__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif
constexpr int kUnits = kLanes / kWidth;
typedef float VecF __attribute__((vector_size(kWidth * sizeof(float))));
typedef double VecD __attribute__((vector_size(kWidth * sizeof(double))));
typedef float VecFUnaligned __attribute__((vector_size(kWidth * sizeof(float)), aligned(4),
                                           may_alias));
struct Lanes {
  VecD v[kUnits];
};

inline VecF load(const float* p) { return *reinterpret_cast<const VecFUnaligned*>(p); }

// Lanes added 0..15 in order.
double lane_sum(const Lanes& l) {
  double s = 0.0;
  for (int u = 0; u < kUnits; ++u) {
    for (int j = 0; j < kWidth; ++j) s += l.v[u][j];
  }
  return s;
}

// What a row's second stream is: none (the stats' sums of d, d^2 with d = x - shift), dy (the
// backward's sums of dy, dy * d with shift = mean), or dy masked by the saved ReLU output y (the
// fused layers' dz = dy where !(y <= 0), else 0: relu_backward's mask, NaN passing).
enum class Grad { kNone, kDy, kMaskedDy };

// Adds the kLanes elements at xs (gs, ys) into the lanes a, b of a row's two sums: a += g,
// b += g * d (one fused multiply-add per lane), d = x - shift, g = d (kNone) or the (masked)
// gradient.
template <Grad kGrad>
inline void add_lanes(const float* __restrict xs, const float* __restrict gs,
                      const float* __restrict ys, const VecD& shift, Lanes& a, Lanes& b) {
  for (int u = 0; u < kUnits; ++u) {
    const VecD d = __builtin_convertvector(load(xs + u * kWidth), VecD) - shift;
    VecD g = d;
    if constexpr (kGrad == Grad::kMaskedDy) {
      const VecF zero = {};
      const VecF y = load(ys + u * kWidth), dy = load(gs + u * kWidth);
      g = __builtin_convertvector(y <= zero ? zero : dy, VecD);
    } else if constexpr (kGrad == Grad::kDy) {
      g = __builtin_convertvector(load(gs + u * kWidth), VecD);
    }
    a.v[u] += g;
    b.v[u] += g * d;
  }
}

// One row (n, c, :): element i goes to lane i % kLanes of the row's own sums, which are then
// added into the channel's lanes s1, s2. The tail is padded with x = shift (and dy = 0), whose
// terms are exactly 0, so every step is a full block.
template <Grad kGrad>
inline void row_sums(const float* __restrict row, const float* __restrict dyrow,
                     const float* __restrict yrow, int64_t HW, double shift_value,
                     Lanes& __restrict s1, Lanes& __restrict s2) {
  constexpr bool kHasDy = kGrad != Grad::kNone, kHasY = kGrad == Grad::kMaskedDy;
  const VecD shift = VecD{} + shift_value;
  Lanes a = {}, b = {};
  int64_t i = 0;
  for (; i + kLanes <= HW; i += kLanes) {
    add_lanes<kGrad>(row + i, kHasDy ? dyrow + i : nullptr, kHasY ? yrow + i : nullptr, shift, a,
                     b);
  }
  if (i < HW) {
    float xs[kLanes], gs[kLanes], ys[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      xs[j] = i + j < HW ? row[i + j] : static_cast<float>(shift_value);
      gs[j] = kHasDy && i + j < HW ? dyrow[i + j] : 0.0f;
      ys[j] = kHasY && i + j < HW ? yrow[i + j] : 0.0f;
    }
    add_lanes<kGrad>(xs, gs, ys, shift, a, b);
  }
  for (int u = 0; u < kUnits; ++u) {
    s1.v[u] += a.v[u];
    s2.v[u] += b.v[u];
  }
}

// The per-channel sums (S1, S2) of channels [c0, c1): runs finish(c, S1, S2) for each, walking n
// outermost so each step reads (c1 - c0) * HW contiguous floats per stream. Each channel's rows
// are added in n order, so the grouping changes no bit. shift(c) is the channel's shift.
template <Grad kGrad, class Shift, class Finish>
void group_sums(int64_t N, int64_t C, int64_t HW, int64_t c0, int64_t c1, const float* x,
                const float* dy, const float* y, Shift&& shift, Finish&& finish) {
  const int64_t G = c1 - c0;
  std::vector<Lanes> s1(static_cast<size_t>(G)), s2(static_cast<size_t>(G));
  std::vector<double> shifts(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) shifts[static_cast<size_t>(g)] = shift(c0 + g);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = (n * C + c0 + g) * HW;
      row_sums<kGrad>(x + at, dy ? dy + at : nullptr, y ? y + at : nullptr, HW,
                      shifts[static_cast<size_t>(g)], s1[static_cast<size_t>(g)],
                      s2[static_cast<size_t>(g)]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    finish(c0 + g, lane_sum(s1[static_cast<size_t>(g)]), lane_sum(s2[static_cast<size_t>(g)]));
  }
}

// group_sums over every channel, in parallel over groups of neighbouring channels (the group
// size follows the shape only).
template <Grad kGrad, class Shift, class Finish>
void channel_sums(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                  const float* y, Shift&& shift, Finish&& finish) {
  const int64_t per_task =
      std::clamp<int64_t>(kRunElements / std::max<int64_t>(HW, 1), 1, std::max<int64_t>(1, C / 8));
  parallel_for((C + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t c0 = task * per_task;
    group_sums<kGrad>(N, C, HW, c0, std::min(C, c0 + per_task), x, dy, y, shift, finish);
  });
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

// The backward's reduce: group_sums' shift (the mean) and finish (sum dz, and sum dz * xhat with
// invstd applied), for every backward kernel alike.
auto grad_shift(const float* mean) {
  return [mean](int64_t c) { return static_cast<double>(mean[c]); };
}
auto grad_finish(const float* var, float eps, float* sum_dz, float* sum_dz_xhat) {
  return [=](int64_t c, double s1, double s2) {
    sum_dz[c] = static_cast<float>(s1);
    sum_dz_xhat[c] = static_cast<float>(s2 * invstd_of(var[c], eps));
  };
}

// Every channel's (sum dz, sum dz * xhat), dz = dy or dy masked by relu's output y (kGrad): the
// backward's reduce with or without the fused relu.
template <Grad kGrad>
void grad_sums(int64_t N, int64_t C, int64_t HW, const float* x, const float* y, const float* dy,
               const float* mean, const float* var, float eps, float* sum_dz,
               float* sum_dz_xhat) {
  channel_sums<kGrad>(N, C, HW, x, dy, y, grad_shift(mean),
                      grad_finish(var, eps, sum_dz, sum_dz_xhat));
}

// Normalising channel c as y = (x - m) * a + b: a = gamma * invstd (invstd without gamma),
// b = beta (0 without beta), m = the mean.
struct NormCoefs {
  float a, b, m;
};
NormCoefs norm_coefs(int64_t c, const float* mean, const float* var, const float* gamma,
                     const float* beta, float eps) {
  const float invstd = invstd_of(var[c], eps);
  return {gamma ? gamma[c] * invstd : invstd, beta ? beta[c] : 0.0f, mean[c]};
}

// Training-mode dx of channel c as k * (dz - mean_dz - (x - mean) * coef): xhat * sum_dz_xhat /
// count with invstd folded into coef. sum_dz, sum_dz_xhat are the rounded float sums.
struct DxCoefs {
  float k, mean_dz, coef, m;
};
DxCoefs dx_coefs(int64_t c, const float* mean, const float* var, const float* gamma,
                 const float* sum_dz, const float* sum_dz_xhat, double count, float eps) {
  const float invstd = invstd_of(var[c], eps);
  return {gamma ? gamma[c] * invstd : invstd, static_cast<float>(sum_dz[c] / count),
          static_cast<float>(sum_dz_xhat[c] * static_cast<double>(invstd) / count), mean[c]};
}

// One row of dx, with dz = dy (y null) or dy masked by relu's output y (!(y <= 0), NaN passing);
// dsp (may be null) gets dz. Every dx kernel runs this, so they all give the same bits.
inline void dx_row(int64_t HW, const DxCoefs& q, const float* __restrict xp,
                   const float* __restrict yp, const float* __restrict dyp, float* __restrict dxp,
                   float* __restrict dsp) {
  const float k = q.k, mean_dz = q.mean_dz, coef = q.coef, m = q.m;
  if (!yp) {
    for (int64_t i = 0; i < HW; ++i) dxp[i] = k * (dyp[i] - mean_dz - (xp[i] - m) * coef);
  } else if (dsp) {
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

}  // namespace

void batch_norm_stats(int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var) {
  const double count = static_cast<double>(N * HW);
  // Shifting by one of the channel's values (its first) keeps the sums small when mean >> std,
  // so S2 - S1^2 / count does not cancel away the variance.
  channel_sums<Grad::kNone>(
      N, C, HW, x, nullptr, nullptr, [&](int64_t c) { return static_cast<double>(x[c * HW]); },
      [&](int64_t c, double sum, double sum_sq) {
        const double shift = x[c * HW];
        mean[c] = static_cast<float>(shift + sum / count);
        var[c] = static_cast<float>(std::max(0.0, (sum_sq - sum * sum / count) / count));
      });
}

void batch_norm_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                        const float* var, const float* gamma, const float* beta, float eps,
                        float* y) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const NormCoefs q = norm_coefs(p % C, mean, var, gamma, beta, eps);
      const float a = q.a, b = q.b, m = q.m;
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
  grad_sums<Grad::kDy>(N, C, HW, x, nullptr, dy, mean, var, eps, sum_dy, sum_dy_xhat);
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
      dx_row(HW, dx_coefs(c, mean, var, gamma, sum_dy, sum_dy_xhat, count, eps), x + p * HW,
             nullptr, dyp, dxp, nullptr);
    }
  });
}

// ---- batch norm + ReLU (+ residual add): the fused step's BatchNormRelu / BatchNormAddRelu ----

void batch_norm_act_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                            const float* var, const float* gamma, const float* beta,
                            const float* shortcut, float eps, float* y) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const NormCoefs q = norm_coefs(p % C, mean, var, gamma, beta, eps);
      const float a = q.a, b = q.b, m = q.m;
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
  grad_sums<Grad::kMaskedDy>(N, C, HW, x, y, dy, mean, var, eps, sum_dz, sum_dz_xhat);
}

void batch_norm_act_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* y,
                             const float* dy, const float* mean, const float* var,
                             const float* gamma, const float* sum_dz, const float* sum_dz_xhat,
                             double count, float eps, float* dx, float* dshortcut) {
  for_plane_blocks(N * C, HW, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      // batch_norm_backward's training formula with dz in place of dy.
      dx_row(HW, dx_coefs(p % C, mean, var, gamma, sum_dz, sum_dz_xhat, count, eps), x + p * HW,
             y + p * HW, dy + p * HW, dx + p * HW, dshortcut ? dshortcut + p * HW : nullptr);
    }
  });
}

// ---- the whole training backward with the replica's own statistics ----

void batch_norm_backward_full(int64_t N, int64_t C, int64_t HW, const float* x, const float* y,
                              const float* dy, const float* mean, const float* var,
                              const float* gamma, float eps, float* sum_dz, float* sum_dz_xhat,
                              float* dx, float* dshortcut) {
  const double count = static_cast<double>(N * HW);
  // Channels per task: as many as keep the task's x, y, dy within kReuseBytes (at least one), so
  // the dx loop finds them in cache, and at most C / 8 (tasks for both threads).
  const int64_t streams = y ? 3 : 2;
  const int64_t channel_bytes = N * HW * streams * static_cast<int64_t>(sizeof(float));
  const int64_t per_task = std::clamp<int64_t>(kReuseBytes / std::max<int64_t>(channel_bytes, 1), 1,
                                               std::max<int64_t>(1, C / 8));
  parallel_for((C + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t c0 = task * per_task, c1 = std::min(C, c0 + per_task);
    const auto shift = grad_shift(mean);
    const auto finish = grad_finish(var, eps, sum_dz, sum_dz_xhat);
    if (y) {
      group_sums<Grad::kMaskedDy>(N, C, HW, c0, c1, x, dy, y, shift, finish);
    } else {
      group_sums<Grad::kDy>(N, C, HW, c0, c1, x, dy, nullptr, shift, finish);
    }
    if (!dx) return;
    std::vector<DxCoefs> q(static_cast<size_t>(c1 - c0));
    for (int64_t c = c0; c < c1; ++c) {
      q[static_cast<size_t>(c - c0)] =
          dx_coefs(c, mean, var, gamma, sum_dz, sum_dz_xhat, count, eps);
    }
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t at = (n * C + c) * HW;
        dx_row(HW, q[static_cast<size_t>(c - c0)], x + at, y ? y + at : nullptr, dy + at,
               dx + at, dshortcut ? dshortcut + at : nullptr);
      }
    }
  });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
