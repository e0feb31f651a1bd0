// cpp/ops/batch_norm_cpu.cpp -- batch norm's CPU kernels: x, y, dy, dx (N, C, HW), per-channel
// arrays (C,). The reductions read their inputs once (shifted sums in double, in parallel over
// fixed groups of channels); forward and dx read and write each element once, in parallel over
// fixed blocks of (n, c) rows. Explicit 16-lane vectors (GCC vector extensions: two zmm registers
// of doubles with AVX-512, four ymm with AVX2), compiled once per instruction-set path
// (cpu_isa.h); each lane does the same operations on both paths, so both give the same bits, and
// results never depend on the thread count.
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

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef double VecD __attribute__((vector_size(kLanes * sizeof(double))));
typedef float VecFUnaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4),
                                           may_alias));

// Vectors go by reference: on the AVX2 path a VecF passed or returned by value would change the
// calling convention (GCC's -Wpsabi); inlined, these are plain moves.
inline void load(VecF& v, const float* p) { v = *reinterpret_cast<const VecFUnaligned*>(p); }

// The first n < kLanes floats at p, the rest fill.
inline void load_part(VecF& v, const float* p, int64_t n, float fill) {
  float t[kLanes];
  for (int j = 0; j < kLanes; ++j) t[j] = j < n ? p[j] : fill;
  load(v, t);
}

// Lanes added 0..15 in order.
double lane_sum(const VecD& v) {
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// What a row's second stream is: none (the stats' sums of d, d^2 with d = x - shift), dy (the
// backward's sums of dy, dy * d with shift = mean), or dy masked by the saved ReLU output y (the
// fused layers' dz = dy where !(y <= 0), else 0: relu_backward's mask, NaN passing).
enum class Grad { kNone, kDy, kMaskedDy };

// Adds kLanes elements into the lanes a, b of a row's two sums: a += g, b += g * d (one fused
// multiply-add per lane), d = x - shift, g = d (kNone) or the (masked) gradient.
template <Grad kGrad>
inline void add_lanes(const VecF& xs, const VecF& gs, const VecF& ys, const VecD& shift, VecD& a,
                      VecD& b) {
  const VecD d = __builtin_convertvector(xs, VecD) - shift;
  VecD g = d;
  if constexpr (kGrad == Grad::kMaskedDy) {
    const VecF zero = {};
    g = __builtin_convertvector(ys <= zero ? zero : gs, VecD);
  } else if constexpr (kGrad == Grad::kDy) {
    g = __builtin_convertvector(gs, VecD);
  }
  a += g;
  b += g * d;
}

// One row (n, c, :): element i goes to lane i % kLanes of the row's own sums, which are then
// added into the channel's lanes s1, s2. The tail is padded with x = shift (and dy = 0), whose
// terms are exactly 0, so every step is a full block.
template <Grad kGrad>
inline void row_sums(const float* __restrict row, const float* __restrict dyrow,
                     const float* __restrict yrow, int64_t HW, double shift_value,
                     VecD& __restrict s1, VecD& __restrict s2) {
  constexpr bool kHasDy = kGrad != Grad::kNone, kHasY = kGrad == Grad::kMaskedDy;
  const VecD shift = VecD{} + shift_value;
  VecD a = {}, b = {};
  VecF xs, gs = {}, ys = {};
  int64_t i = 0;
  for (; i + kLanes <= HW; i += kLanes) {
    load(xs, row + i);
    if constexpr (kHasDy) load(gs, dyrow + i);
    if constexpr (kHasY) load(ys, yrow + i);
    add_lanes<kGrad>(xs, gs, ys, shift, a, b);
  }
  if (i < HW) {
    const int64_t rest = HW - i;
    load_part(xs, row + i, rest, static_cast<float>(shift_value));
    if constexpr (kHasDy) load_part(gs, dyrow + i, rest, 0.0f);
    if constexpr (kHasY) load_part(ys, yrow + i, rest, 0.0f);
    add_lanes<kGrad>(xs, gs, ys, shift, a, b);
  }
  s1 += a;
  s2 += b;
}

// The per-channel sums (S1, S2) of a reduction: runs finish(c, S1, S2) for every channel, in
// parallel over groups of neighbouring channels. Each channel's rows are added in n order, so the
// grouping (which follows the shape only) changes no bit. shift(c) is the channel's shift.
template <Grad kGrad, class Shift, class Finish>
void channel_sums(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                  const float* y, Shift&& shift, Finish&& finish) {
  const int64_t per_task =
      std::clamp<int64_t>(kRunElements / std::max<int64_t>(HW, 1), 1, std::max<int64_t>(1, C / 8));
  parallel_for((C + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t c0 = task * per_task, c1 = std::min(C, c0 + per_task), G = c1 - c0;
    std::vector<VecD> s1(static_cast<size_t>(G)), s2(static_cast<size_t>(G));
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
  channel_sums<Grad::kDy>(
      N, C, HW, x, dy, nullptr, [&](int64_t c) { return static_cast<double>(mean[c]); },
      [&](int64_t c, double s1, double s2) {
        sum_dy[c] = static_cast<float>(s1);
        sum_dy_xhat[c] = static_cast<float>(s2 * invstd_of(var[c], eps));
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
  channel_sums<Grad::kMaskedDy>(
      N, C, HW, x, dy, y, [&](int64_t c) { return static_cast<double>(mean[c]); },
      [&](int64_t c, double s1, double s2) {
        sum_dz[c] = static_cast<float>(s1);
        sum_dz_xhat[c] = static_cast<float>(s2 * invstd_of(var[c], eps));
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
