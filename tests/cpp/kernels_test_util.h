// tests/cpp/kernels_test_util.h -- helpers shared by the CPU kernel tests (test_kernels.cpp,
// test_kernels_loss_norm.cpp): the tolerance table, a seeded data stream, the closeness check,
// the double-precision reference loops, and a scoped thread count.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "ops/argmax.h"
#include "ops/avg_pool2d.h"
#include "ops/batch_norm.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/max_pool2d.h"
#include "ops/softmax_ce.h"

namespace mgpu_test {

using mgpu::ops::Conv2dShape;
using Floats = std::vector<float>;
using Doubles = std::vector<double>;

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- tolerances: one table ----
// Element-wise kernels round once per element, so they match the double reference to 1e-6.
// Sums over many float terms (conv, pool, loss, matmul, batch sums) round once per term, in an
// order the reference does not share: rtol 1e-4 with atol 1e-5 for results that cancel to ~0.
struct Tol {
  double rtol, atol;
};
inline constexpr Tol kElementwise{1e-6, 1e-6};
inline constexpr Tol kSum{1e-4, 1e-5};

// Deterministic data: a fixed splitmix64 stream, so failures reproduce on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  float uniform(float lo, float hi) {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * static_cast<float>(z >> 40) / static_cast<float>(1ull << 24);
  }
  Floats floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
    Floats v(n);
    for (float& e : v) e = uniform(lo, hi);
    return v;
  }

 private:
  uint64_t state_;
};

// Compares got with want elementwise: |got - want| <= atol + rtol * |want|. On failure names the
// op, the worst index, expected vs got, and the max abs and rel errors.
inline ::testing::AssertionResult all_close(const std::string& what, const Floats& got,
                                            const Doubles& want, Tol tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": got " << got.size() << " values, expected " << want.size();
  }
  double worst_excess = 0.0, max_abs = 0.0, max_rel = 0.0;
  size_t worst = 0;
  bool bad = false;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(want[i]);
    if (!(err <= allowed)) {  // also catches NaN
      bad = true;
      const double excess =
          std::isnan(err) ? std::numeric_limits<double>::infinity() : err - allowed;
      if (excess >= worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
    if (!std::isnan(err)) {
      max_abs = std::max(max_abs, err);
      if (want[i] != 0.0) max_rel = std::max(max_rel, err / std::fabs(want[i]));
    }
  }
  if (!bad) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": worst at index " << worst << ": expected " << want[worst] << ", got "
         << got[worst] << " (max abs err " << max_abs << ", max rel err " << max_rel << ", rtol "
         << tol.rtol << ", atol " << tol.atol << ")";
}

inline bool same_bits(const Floats& a, const Floats& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- references: plain loops in double ----

inline int64_t numel(const Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
inline int64_t out_numel(const Conv2dShape& s) { return s.N * s.K * s.P() * s.Q(); }
inline int64_t w_numel(const Conv2dShape& s) { return s.K * s.C * s.R * s.S; }

// Calls fn(y_index, w_index, x_index) for every (output, tap) pair that reads inside the image.
template <class F>
void for_each_tap(const Conv2dShape& s, F&& fn) {
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t k = 0; k < s.K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q)
          for (int64_t c = 0; c < s.C; ++c)
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t t = 0; t < s.S; ++t) {
                const int64_t h = p * s.stride - s.pad + r, w = q * s.stride - s.pad + t;
                if (h < 0 || h >= s.H || w < 0 || w >= s.W) continue;
                fn(((n * s.K + k) * P + p) * Q + q, ((k * s.C + c) * s.R + r) * s.S + t,
                   ((n * s.C + c) * s.H + h) * s.W + w);
              }
}

inline Doubles ref_conv_forward(const Conv2dShape& s, const Floats& x, const Floats& w,
                                const Floats* b) {
  Doubles y(static_cast<size_t>(out_numel(s)));
  const int64_t PQ = s.P() * s.Q();
  for (size_t i = 0; i < y.size(); ++i) y[i] = b ? (*b)[(i / PQ) % s.K] : 0.0;
  for_each_tap(
      s, [&](int64_t yi, int64_t wi, int64_t xi) { y[yi] += static_cast<double>(w[wi]) * x[xi]; });
  return y;
}

struct ConvGrads {
  Doubles dx, dw, db;
};
inline ConvGrads ref_conv_backward(const Conv2dShape& s, const Floats& x, const Floats& w,
                                   const Floats& dy) {
  ConvGrads g{Doubles(x.size()), Doubles(w.size()), Doubles(static_cast<size_t>(s.K))};
  const int64_t PQ = s.P() * s.Q();
  for (size_t i = 0; i < dy.size(); ++i) g.db[(i / PQ) % s.K] += dy[i];
  for_each_tap(s, [&](int64_t yi, int64_t wi, int64_t xi) {
    g.dx[xi] += static_cast<double>(w[wi]) * dy[yi];
    g.dw[wi] += static_cast<double>(x[xi]) * dy[yi];
  });
  return g;
}

struct PoolShape {
  int64_t N, C, H, W, kh, kw, sh, sw;
  int64_t P() const { return (H - kh) / sh + 1; }
  int64_t Q() const { return (W - kw) / sw + 1; }
};

// Calls fn(y_index, x_index) for every window element.
template <class F>
void for_each_window_elem(const PoolShape& s, F&& fn) {
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t nc = 0; nc < s.N * s.C; ++nc)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t i = 0; i < s.kh; ++i)
          for (int64_t j = 0; j < s.kw; ++j)
            fn((nc * P + p) * Q + q, (nc * s.H + p * s.sh + i) * s.W + q * s.sw + j);
}

inline Doubles ref_pool_forward(const PoolShape& s, const Floats& x) {
  Doubles y(static_cast<size_t>(s.N * s.C * s.P() * s.Q()));
  const double area = static_cast<double>(s.kh * s.kw);
  for_each_window_elem(s, [&](int64_t yi, int64_t xi) { y[yi] += x[xi] / area; });
  return y;
}

inline Doubles ref_pool_backward(const PoolShape& s, const Floats& dy) {
  Doubles dx(static_cast<size_t>(s.N * s.C * s.H * s.W));
  const double area = static_cast<double>(s.kh * s.kw);
  for_each_window_elem(s, [&](int64_t yi, int64_t xi) { dx[xi] += dy[yi] / area; });
  return dx;
}

// loss_i and dlogits_i in double; the max shift keeps exp finite for logits near +-1000.
template <class Label>
void ref_softmax_ce(int64_t n, int64_t m, const Floats& z, const std::vector<Label>& labels,
                    const Floats& dloss, Doubles* loss, Doubles* dz) {
  loss->assign(static_cast<size_t>(n), 0.0);
  dz->assign(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < m; ++j) mx = std::max(mx, static_cast<double>(z[i * m + j]));
    double sum = 0.0;
    for (int64_t j = 0; j < m; ++j) sum += std::exp(z[i * m + j] - mx);
    const int64_t y = static_cast<int64_t>(labels[i]);
    (*loss)[i] = std::log(sum) + mx - z[i * m + y];
    for (int64_t j = 0; j < m; ++j) {
      const double p = std::exp(z[i * m + j] - mx) / sum;
      (*dz)[i * m + j] = (p - (j == y ? 1.0 : 0.0)) * dloss[i];
    }
  }
}

// Sets the thread count for one scope and restores it after.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(mgpu::num_threads()) { mgpu::set_num_threads(n); }
  ~ThreadCount() { mgpu::set_num_threads(saved_); }

 private:
  int saved_;
};

}  // namespace mgpu_test
