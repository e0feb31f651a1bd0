// tests/cpp/test_kernels.cpp -- the raw CPU kernels (the ops' cpu:: declarations, gemm.h) against naive
// direct-loop references in double precision, over shapes with batch 1, odd and non-square sizes,
// stride, padding and LeNet's own; plus the contracts: outputs are written (never accumulated),
// labels are checked, and the bits do not depend on the thread count.
// Shape letters: N batch, C in-channels, K out-channels, H/W image, R/S kernel, P/Q output.
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

namespace {

using namespace mgpu::ops::cpu;
using mgpu::ops::Conv2dShape;
using Floats = std::vector<float>;
using Doubles = std::vector<double>;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- tolerances: one table ----
// Element-wise kernels round once per element, so they match the double reference to 1e-6.
// Sums over many float terms (conv, pool, loss, matmul, batch sums) round once per term, in an
// order the reference does not share: rtol 1e-4 with atol 1e-5 for results that cancel to ~0.
struct Tol {
  double rtol, atol;
};
constexpr Tol kElementwise{1e-6, 1e-6};
constexpr Tol kSum{1e-4, 1e-5};

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
::testing::AssertionResult all_close(const std::string& what, const Floats& got,
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

bool same_bits(const Floats& a, const Floats& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- references: plain loops in double ----

int64_t numel(const Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
int64_t out_numel(const Conv2dShape& s) { return s.N * s.K * s.P() * s.Q(); }
int64_t w_numel(const Conv2dShape& s) { return s.K * s.C * s.R * s.S; }

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

Doubles ref_conv_forward(const Conv2dShape& s, const Floats& x, const Floats& w, const Floats* b) {
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
ConvGrads ref_conv_backward(const Conv2dShape& s, const Floats& x, const Floats& w,
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

Doubles ref_pool_forward(const PoolShape& s, const Floats& x) {
  Doubles y(static_cast<size_t>(s.N * s.C * s.P() * s.Q()));
  const double area = static_cast<double>(s.kh * s.kw);
  for_each_window_elem(s, [&](int64_t yi, int64_t xi) { y[yi] += x[xi] / area; });
  return y;
}

Doubles ref_pool_backward(const PoolShape& s, const Floats& dy) {
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

// ================================ sgemm ================================

// Row-major matrices with padded rows (ld > cols), so wrong strides show up.
struct Padded {
  int64_t rows, cols, ld;
  Floats v;
  Padded(int64_t r, int64_t c, int64_t pad, Rng& rng)
      : rows(r), cols(c), ld(c + pad), v(rng.floats(static_cast<size_t>(r * (c + pad)))) {}
  double at(int64_t i, int64_t j) const { return v[i * ld + j]; }
};

TEST(Sgemm, AllTransposesWithPaddedStrides) {
  const int64_t m = 5, n = 7, k = 6;
  const float alpha = 0.75f, beta = -0.5f;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Rng rng(11 + 2 * ta + tb);
      const Padded a = ta ? Padded(k, m, 3, rng) : Padded(m, k, 3, rng);
      const Padded b = tb ? Padded(n, k, 2, rng) : Padded(k, n, 2, rng);
      Padded c(m, n, 4, rng);
      Doubles want(c.v.begin(), c.v.end());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0.0;
          for (int64_t l = 0; l < k; ++l)
            sum += (ta ? a.at(l, i) : a.at(i, l)) * (tb ? b.at(j, l) : b.at(l, j));
          want[i * c.ld + j] = alpha * sum + beta * c.at(i, j);
        }
      }
      // Padding columns of C must be left alone: want keeps their old values.
      sgemm(ta, tb, m, n, k, alpha, a.v.data(), a.ld, b.v.data(), b.ld, beta, c.v.data(), c.ld);
      EXPECT_TRUE(all_close(
          std::string("sgemm trans_a=") + (ta ? "1" : "0") + " trans_b=" + (tb ? "1" : "0"), c.v,
          want, kSum));
    }
  }
}

TEST(Sgemm, BetaZeroOverwritesNaN) {
  Rng rng(3);
  const Floats a = rng.floats(4 * 3), b = rng.floats(3 * 2);
  Floats c(4 * 2, kNaN);
  sgemm(false, false, 4, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  Doubles want(c.size());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int l = 0; l < 3; ++l)
        want[i * 2 + j] += static_cast<double>(a[i * 3 + l]) * b[l * 2 + j];
  EXPECT_TRUE(all_close("sgemm beta=0", c, want, kSum));
}

TEST(Sgemm, EmptyInnerDimensionScalesC) {
  Floats c = {1.0f, -2.0f, 3.0f, kNaN};
  sgemm(false, false, 1, 3, 0, 1.0f, nullptr, 1, nullptr, 3, 2.0f, c.data(), 4);
  EXPECT_EQ(c[0], 2.0f);
  EXPECT_EQ(c[1], -4.0f);
  EXPECT_EQ(c[2], 6.0f);
  EXPECT_TRUE(std::isnan(c[3]));  // outside the 1x3 matrix
  // beta == 0 never reads C, so a NaN there is overwritten.
  c[0] = kNaN;
  sgemm(false, false, 1, 3, 0, 1.0f, nullptr, 1, nullptr, 3, 0.0f, c.data(), 4);
  EXPECT_EQ(c[0], 0.0f);
  sgemm(false, false, 0, 3, 2, 1.0f, nullptr, 2, nullptr, 3, 0.0f, nullptr, 3);  // m == 0: no-op
}

TEST(Sgemm, BadStrideThrowsInsteadOfPrinting) {
  Floats a(6), b(6), c(4);
  EXPECT_THROW(sgemm(false, false, 2, 2, 3, 1.0f, a.data(), 2, b.data(), 2, 0.0f, c.data(), 2),
               std::invalid_argument);
}

// ================================ conv2d ================================

struct ConvCase {
  const char* name;
  Conv2dShape s;
};

// N=19 spans two full blocks of 8 images and a partial one (the dw/db batch sum). Patches of 64
// floats or more (C*R*S) take backward's im2col_rows path, padded and strided ones included.
const ConvCase kConvCases[] = {
    {"batch1_3x3", {1, 1, 5, 5, 1, 3, 3, 1, 0}},
    {"odd_nonsquare_pad1", {2, 3, 7, 5, 4, 3, 3, 1, 1}},
    {"stride2_pad1", {3, 2, 9, 11, 5, 3, 3, 2, 1}},
    {"pad2_5x5", {2, 3, 8, 7, 2, 5, 5, 1, 2}},
    {"rect_kernel_stride2_pad2", {1, 2, 6, 9, 3, 2, 4, 2, 2}},
    {"kernel_1x1", {3, 4, 5, 6, 3, 1, 1, 1, 0}},
    {"kernel_wider_than_image", {2, 2, 3, 2, 3, 5, 4, 1, 2}},
    {"stride3_floor", {2, 2, 10, 8, 3, 3, 2, 3, 1}},
    {"c1_pad1_batch17", {17, 1, 9, 7, 4, 3, 3, 1, 1}},
    {"lenet_conv1", {19, 1, 28, 28, 20, 3, 3, 1, 0}},
    {"lenet_conv2", {19, 20, 13, 13, 50, 5, 5, 1, 0}},
    {"wide_patch_pad2", {3, 4, 7, 8, 5, 5, 5, 1, 2}},
    {"wide_patch_stride2_pad1", {6, 8, 9, 10, 6, 3, 3, 2, 1}},
    // The direct path (C*R*S <= 16, stride 1, no padding, Q >= 16): rows of exactly one chunk,
    // rows whose last chunk overlaps the one before, and the largest tap count.
    {"direct_q16", {2, 1, 18, 18, 4, 3, 3, 1, 0}},
    {"direct_c2_2x3_q17", {9, 2, 9, 19, 3, 2, 3, 1, 0}},
    {"direct_1x1_c16_q40", {3, 16, 4, 40, 5, 1, 1, 1, 0}},
    // The lane path (stride 1, no padding, more taps): a short last block, tile tails in every
    // direction, border and interior columns of dx, and outputs narrower than the kernel.
    {"lanes_tails_batch33", {33, 3, 8, 11, 7, 3, 4, 1, 0}},
    {"lanes_q_below_s", {3, 2, 6, 6, 3, 5, 5, 1, 0}},
    {"lanes_1x17_c1", {18, 1, 3, 20, 2, 1, 17, 1, 0}},
};

void PrintTo(const ConvCase& c, std::ostream* os) { *os << c.name; }

class Conv2dTest : public ::testing::TestWithParam<ConvCase> {};

// Data at training scale: x ~ 1, weights scaled by fan-in, dy by the number of terms dw sums, so
// every result is O(1). (Unit data in all three would make LeNet's sums of ~1500 unit-sized terms,
// whose rounding near a zero result approaches atol for reasons unrelated to the kernel.)
struct ConvData {
  Floats x, w, b, dy;
  ConvData(const Conv2dShape& s, uint64_t seed) {
    Rng rng(seed);
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(s.C * s.R * s.S));
    const float dy_scale =
        1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(1, s.N * s.P() * s.Q())));
    x = rng.floats(numel(s));
    w = rng.floats(w_numel(s), -w_scale, w_scale);
    b = rng.floats(s.K);
    dy = rng.floats(out_numel(s), -dy_scale, dy_scale);
  }
};

TEST_P(Conv2dTest, ForwardMatchesReference) {
  const Conv2dShape s = GetParam().s;
  const ConvData d(s, 1);
  const Floats &x = d.x, &w = d.w, &b = d.b;
  Floats y(out_numel(s), kNaN);  // NaN survives anywhere the kernel fails to write
  conv2d_forward(s, x.data(), w.data(), b.data(), y.data());
  EXPECT_TRUE(all_close("conv2d_forward", y, ref_conv_forward(s, x, w, &b), kSum));

  Floats y_nobias(out_numel(s), kNaN);
  conv2d_forward(s, x.data(), w.data(), nullptr, y_nobias.data());
  EXPECT_TRUE(
      all_close("conv2d_forward without bias", y_nobias, ref_conv_forward(s, x, w, nullptr), kSum));
}

TEST_P(Conv2dTest, BackwardMatchesReference) {
  const Conv2dShape s = GetParam().s;
  const ConvData d(s, 2);
  const Floats &x = d.x, &w = d.w, &dy = d.dy;
  Floats dx(numel(s), kNaN), dw(w_numel(s), kNaN), db(s.K, kNaN);
  conv2d_backward(s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data());
  const ConvGrads want = ref_conv_backward(s, x, w, dy);
  EXPECT_TRUE(all_close("conv2d_backward dx", dx, want.dx, kSum));
  EXPECT_TRUE(all_close("conv2d_backward dw", dw, want.dw, kSum));
  EXPECT_TRUE(all_close("conv2d_backward db", db, want.db, kSum));

  // Skipping dx and db (LeNet's first layer) leaves dw's bits unchanged.
  Floats dw_only(w_numel(s), kNaN);
  conv2d_backward(s, x.data(), w.data(), dy.data(), nullptr, dw_only.data(), nullptr);
  EXPECT_TRUE(same_bits(dw_only, dw));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dTest, ::testing::ValuesIn(kConvCases),
                         [](const ::testing::TestParamInfo<ConvCase>& param) {
                           return std::string(param.param.name);
                         });

TEST(Conv2d, BackwardOfEmptyBatchWritesZeroGradients) {
  const Conv2dShape s{0, 2, 5, 5, 3, 3, 3, 1, 0};
  Floats w(w_numel(s), 1.0f), dw(w_numel(s), kNaN), db(s.K, kNaN);
  conv2d_backward(s, nullptr, w.data(), nullptr, nullptr, dw.data(), db.data());
  EXPECT_TRUE(all_close("conv2d_backward dw, N=0", dw, Doubles(dw.size()), kElementwise));
  EXPECT_TRUE(all_close("conv2d_backward db, N=0", db, Doubles(db.size()), kElementwise));
}

// ================================ conv2d + relu + avg_pool2d, fused ================================

struct FusedCase {
  const char* name;
  Conv2dShape s;
  int64_t pool;
};

// Odd P and Q leave a row and a column that no window covers; N=19 spans partial blocks.
const FusedCase kFusedCases[] = {
    {"batch1_pool2_odd", {1, 2, 7, 8, 3, 3, 3, 1, 0}, 2},
    {"pool3_nonsquare", {3, 2, 10, 9, 4, 2, 3, 1, 0}, 3},
    {"pool1", {2, 3, 6, 6, 2, 3, 3, 1, 0}, 1},
    {"lenet_conv1", {19, 1, 28, 28, 20, 3, 3, 1, 0}, 2},
    {"lenet_conv2", {19, 20, 13, 13, 50, 5, 5, 1, 0}, 2},
    // Direct and lane convolutions with odd P and Q (the row and column no window covers still
    // get their mask), with 3x3 windows, and a 16-column pooling pass behind im2col.
    {"direct_pool2_odd_pq", {10, 2, 11, 19, 4, 2, 3, 1, 0}, 2},
    {"direct_pool2_wide", {3, 1, 21, 37, 3, 3, 3, 1, 0}, 2},
    // Odd channel counts on one channel's 3x3 taps (the AVX2 path's shared tap rows) and on taps
    // over two channels.
    {"direct_pool2_k11", {3, 1, 19, 18, 11, 3, 3, 1, 0}, 2},
    {"direct_pool2_c2_k7", {2, 2, 9, 20, 7, 2, 3, 1, 0}, 2},
    {"direct_pool3", {4, 1, 19, 19, 2, 3, 3, 1, 0}, 3},
    {"lanes_pool2_odd_pq", {17, 3, 12, 13, 6, 4, 4, 1, 0}, 2},
    {"lanes_pool3", {5, 2, 10, 11, 4, 3, 3, 1, 0}, 3},
    {"im2col_pad1_pool2_q22", {3, 3, 20, 22, 4, 3, 3, 1, 1}, 2},
};

void PrintTo(const FusedCase& c, std::ostream* os) { *os << c.name; }

class ConvReluPoolTest : public ::testing::TestWithParam<FusedCase> {};

// relu as relu_forward computes it: NaN passes (!(e <= 0) is true for NaN).
Floats relu(Floats v) {
  for (float& e : v) e = !(e <= 0.0f) ? e : 0.0f;
  return v;
}

// Equal floats, bit for bit, where a is not NaN; NaN where a is NaN (its payload aside).
bool same_bits_or_nan(const Floats& a, const Floats& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) ? !std::isnan(b[i]) : std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return false;
  }
  return true;
}

// The fused kernels promise the bits of the op-by-op chain, at any thread count (NaN where the
// chain has NaN).
void expect_fused_equals_chain(const Conv2dShape& s, int64_t k, const ConvData& d) {
  const PoolShape ps{s.N, s.K, s.P(), s.Q(), k, k, k, k};
  Rng rng(6);
  const Floats dpooled = rng.floats(s.N * s.K * ps.P() * ps.Q());

  // The chain: conv2d_forward, relu, avg_pool2d_forward; then the backward in reverse.
  Floats y(out_numel(s)), pooled(dpooled.size());
  conv2d_forward(s, d.x.data(), d.w.data(), d.b.data(), y.data());
  const Floats a = relu(y);
  avg_pool2d_forward(ps.N, ps.C, ps.H, ps.W, k, k, k, k, a.data(), pooled.data());
  Floats da(y.size()), dy(y.size()), dx(numel(s)), dw(w_numel(s)), db(s.K);
  avg_pool2d_backward(ps.N, ps.C, ps.H, ps.W, k, k, k, k, dpooled.data(), da.data());
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = !(y[i] <= 0.0f) ? da[i] : 0.0f;
  conv2d_backward(s, d.x.data(), d.w.data(), dy.data(), dx.data(), dw.data(), db.data());
  const bool has_nan = std::any_of(d.x.begin(), d.x.end(), [](float v) { return std::isnan(v); });
  if (!has_nan) {
    EXPECT_TRUE(all_close("chain vs reference", pooled, ref_pool_forward(ps, relu(y)), kSum));
  }

  for (int threads : {1, 3}) {
    ThreadCount count(threads);
    std::vector<uint8_t> mask(y.size(), 7);
    Floats fpooled(pooled.size(), kNaN), fpooled_only(pooled.size(), kNaN);
    conv2d_relu_pool_forward(s, k, d.x.data(), d.w.data(), d.b.data(), mask.data(),
                             fpooled.data());
    conv2d_relu_pool_forward(s, k, d.x.data(), d.w.data(), d.b.data(), nullptr,
                             fpooled_only.data());
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_EQ(mask[i], !(y[i] <= 0.0f) ? 1 : 0) << "mask[" << i << "], " << threads
                                                    << " threads";
    }
    EXPECT_TRUE(same_bits_or_nan(pooled, fpooled)) << threads << " threads";
    EXPECT_TRUE(same_bits_or_nan(pooled, fpooled_only)) << threads << " threads";

    Floats fdx(dx.size(), kNaN), fdw(dw.size(), kNaN), fdb(db.size(), kNaN);
    conv2d_relu_pool_backward(s, k, d.x.data(), d.w.data(), mask.data(), dpooled.data(),
                              fdx.data(), fdw.data(), fdb.data());
    EXPECT_TRUE(same_bits_or_nan(dx, fdx)) << threads << " threads";
    EXPECT_TRUE(same_bits_or_nan(dw, fdw)) << threads << " threads";
    EXPECT_TRUE(same_bits_or_nan(db, fdb)) << threads << " threads";
    Floats fdw_only(dw.size(), kNaN);
    conv2d_relu_pool_backward(s, k, d.x.data(), d.w.data(), mask.data(), dpooled.data(),
                              nullptr, fdw_only.data(), nullptr);
    EXPECT_TRUE(same_bits_or_nan(dw, fdw_only)) << threads << " threads";
  }
}

TEST_P(ConvReluPoolTest, EqualsConvReluPoolChainBitForBit) {
  expect_fused_equals_chain(GetParam().s, GetParam().pool, ConvData(GetParam().s, 5));
}

// NaN in the image reaches relu as NaN, which passes it (as relu_forward and PyTorch do): the
// windows that hold it pool to NaN and its mask is set. NaN at the first pixel, one in the
// middle and the last pixel (so also in the row and column no window covers, for odd P, Q).
TEST_P(ConvReluPoolTest, NaNPropagatesAsInTheChain) {
  const Conv2dShape s = GetParam().s;
  ConvData d(s, 5);
  d.x.front() = kNaN;
  d.x[d.x.size() / 2] = kNaN;
  d.x.back() = kNaN;
  expect_fused_equals_chain(s, GetParam().pool, d);
  // Not vacuous: the NaNs reach pooled outputs.
  const PoolShape ps{s.N, s.K, s.P(), s.Q(), GetParam().pool, GetParam().pool, GetParam().pool,
                     GetParam().pool};
  Floats pooled(static_cast<size_t>(s.N * s.K * ps.P() * ps.Q()));
  conv2d_relu_pool_forward(s, GetParam().pool, d.x.data(), d.w.data(), d.b.data(), nullptr,
                           pooled.data());
  EXPECT_TRUE(std::isnan(pooled.front())) << "the first window holds the first pixel's NaN";
  EXPECT_TRUE(std::any_of(pooled.begin(), pooled.end(), [](float v) { return std::isnan(v); }));
  EXPECT_FALSE(std::all_of(pooled.begin(), pooled.end(), [](float v) { return std::isnan(v); }));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConvReluPoolTest, ::testing::ValuesIn(kFusedCases),
                         [](const ::testing::TestParamInfo<FusedCase>& param) {
                           return std::string(param.param.name);
                         });

// ================================ avg_pool2d ================================

struct PoolCase {
  const char* name;
  PoolShape s;
};

const PoolCase kPoolCases[] = {
    {"batch1_2x2s2", {1, 1, 4, 4, 2, 2, 2, 2}},
    {"lenet_pool2_floor_9_to_4", {2, 3, 9, 9, 2, 2, 2, 2}},
    {"lenet_pool1", {3, 20, 26, 26, 2, 2, 2, 2}},
    {"k3x2_s2x1_overlap", {2, 3, 7, 6, 3, 2, 2, 1}},
    {"k3_s1_overlap_nonsquare", {1, 2, 5, 8, 3, 3, 1, 1}},
    {"stride_beyond_kernel_gaps", {2, 2, 11, 7, 2, 3, 3, 2}},
    {"global", {2, 3, 5, 4, 5, 4, 1, 1}},
};

void PrintTo(const PoolCase& c, std::ostream* os) { *os << c.name; }

class AvgPool2dTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(AvgPool2dTest, ForwardAndBackwardMatchReference) {
  const PoolShape s = GetParam().s;
  Rng rng(4);
  const Floats x = rng.floats(s.N * s.C * s.H * s.W), dy = rng.floats(s.N * s.C * s.P() * s.Q());
  Floats y(dy.size(), kNaN), dx(x.size(), kNaN);
  avg_pool2d_forward(s.N, s.C, s.H, s.W, s.kh, s.kw, s.sh, s.sw, x.data(), y.data());
  avg_pool2d_backward(s.N, s.C, s.H, s.W, s.kh, s.kw, s.sh, s.sw, dy.data(), dx.data());
  EXPECT_TRUE(all_close("avg_pool2d_forward", y, ref_pool_forward(s, x), kSum));
  EXPECT_TRUE(all_close("avg_pool2d_backward", dx, ref_pool_backward(s, dy), kSum));
}

INSTANTIATE_TEST_SUITE_P(Shapes, AvgPool2dTest, ::testing::ValuesIn(kPoolCases),
                         [](const ::testing::TestParamInfo<PoolCase>& param) {
                           return std::string(param.param.name);
                         });

TEST(AvgPool2d, FloorDropsLastRowAndColumn) {
  // 3x3 input, 2x2 stride 2: one window over the top-left 2x2; row 2 and column 2 get no gradient.
  const Floats x = {1, 2, 100, 3, 4, 100, 100, 100, 100};
  Floats y(1, kNaN);
  avg_pool2d_forward(1, 1, 3, 3, 2, 2, 2, 2, x.data(), y.data());
  EXPECT_EQ(y[0], 2.5f);
  const Floats dy = {8.0f};
  Floats dx(9, kNaN);
  avg_pool2d_backward(1, 1, 3, 3, 2, 2, 2, 2, dy.data(), dx.data());
  EXPECT_EQ(dx, (Floats{2, 2, 0, 2, 2, 0, 0, 0, 0}));
}

// ================================ max_pool2d ================================

using mgpu::ops::MaxPoolShape;

// The winner of every window, read in row-major order from -inf at its first image element: a
// value wins if greater than the best so far, or NaN (PyTorch's CPU rule).
void ref_max_pool(const MaxPoolShape& s, const Floats& x, Doubles* y, std::vector<int32_t>* at) {
  const int64_t P = s.P(), Q = s.Q();
  y->assign(static_cast<size_t>(s.N * s.C * P * Q), 0.0);
  at->assign(y->size(), -1);
  for (int64_t nc = 0; nc < s.N * s.C; ++nc)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        const int64_t h0 = std::max<int64_t>(p * s.sh - s.ph, 0);
        const int64_t h1 = std::min(p * s.sh - s.ph + s.kh, s.H);
        const int64_t w0 = std::max<int64_t>(q * s.sw - s.pw, 0);
        const int64_t w1 = std::min(q * s.sw - s.pw + s.kw, s.W);
        double best = -INFINITY;
        int64_t win = h0 * s.W + w0;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) {
            const double v = x[static_cast<size_t>(nc * s.H * s.W + h * s.W + w)];
            if (v > best || std::isnan(v)) best = v, win = h * s.W + w;
          }
        const size_t o = static_cast<size_t>((nc * P + p) * Q + q);
        (*y)[o] = best;
        (*at)[o] = static_cast<int32_t>(win);
      }
}

struct MaxPoolCase {
  const char* name;
  MaxPoolShape s;
  bool ties;  // values from {0, 1, 2}: most windows hold their maximum more than once
};

const MaxPoolCase kMaxPoolCases[] = {
    {"batch1_2x2", {1, 1, 4, 4, 2, 2, 2, 2, 0, 0}, false},
    {"resnet_stem_odd_nonsquare", {2, 3, 11, 7, 3, 3, 2, 2, 1, 1}, false},
    {"resnet_stem_ties", {2, 3, 11, 7, 3, 3, 2, 2, 1, 1}, true},
    {"wide_rows_vector_tail", {2, 2, 9, 37, 3, 3, 2, 2, 1, 1}, true},
    {"k3x2_s1x2_pad1", {1, 2, 5, 8, 3, 2, 1, 2, 1, 1}, true},
    {"gaps_k2x3_s3x1", {3, 2, 7, 6, 2, 3, 3, 1, 1, 0}, false},
    {"whole_map", {2, 1, 3, 5, 3, 5, 1, 1, 0, 0}, true},
};

void PrintTo(const MaxPoolCase& c, std::ostream* os) { *os << c.name; }

class MaxPool2dTest : public ::testing::TestWithParam<MaxPoolCase> {};

TEST_P(MaxPool2dTest, ForwardAndBackwardMatchReference) {
  const MaxPoolShape s = GetParam().s;
  Rng rng(5);
  Floats x = rng.floats(s.N * s.C * s.H * s.W);
  if (GetParam().ties)
    for (float& v : x) v = std::floor((v + 1.0f) * 1.5f);
  const Floats dy = rng.floats(s.N * s.C * s.P() * s.Q());
  Floats y(dy.size(), kNaN), dx(x.size(), kNaN);
  std::vector<int32_t> at(dy.size(), -7);
  max_pool2d_forward(s, x.data(), y.data(), at.data());
  Doubles want_y;
  std::vector<int32_t> want_at;
  ref_max_pool(s, x, &want_y, &want_at);
  EXPECT_TRUE(all_close("max_pool2d_forward", y, want_y, kElementwise));
  EXPECT_EQ(at, want_at);
  max_pool2d_backward(s, at.data(), dy.data(), dx.data());
  Doubles want_dx(x.size(), 0.0);
  for (int64_t nc = 0; nc < s.N * s.C; ++nc)
    for (int64_t o = 0; o < s.P() * s.Q(); ++o) {
      const size_t yi = static_cast<size_t>(nc * s.P() * s.Q() + o);
      want_dx[static_cast<size_t>(nc * s.H * s.W + want_at[yi])] += dy[yi];
    }
  EXPECT_TRUE(all_close("max_pool2d_backward", dx, want_dx, kSum));
  // Without indices, the same y.
  Floats y_only(dy.size(), kNaN);
  max_pool2d_forward(s, x.data(), y_only.data(), nullptr);
  EXPECT_EQ(0, std::memcmp(y.data(), y_only.data(), y.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, MaxPool2dTest, ::testing::ValuesIn(kMaxPoolCases),
                         [](const ::testing::TestParamInfo<MaxPoolCase>& param) {
                           return std::string(param.param.name);
                         });

TEST(MaxPool2d, TiesGoToTheFirstInRowMajorOrderAndNaNsToTheLast) {
  // 9 at (0, 1) and (1, 0): row-major order reaches (0, 1) first.
  const MaxPoolShape s{1, 1, 2, 2, 2, 2, 2, 2, 0, 0};
  const Floats x = {0, 9, 9, 0};
  Floats y(1);
  int32_t at = -1;
  max_pool2d_forward(s, x.data(), y.data(), &at);
  EXPECT_EQ(y[0], 9.0f);
  EXPECT_EQ(at, 1);
  const Floats nans = {1, kNaN, kNaN, 5};
  max_pool2d_forward(s, nans.data(), y.data(), &at);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(at, 2);
  // Two NaNs in one row: the later column.
  const Floats row_nans = {kNaN, kNaN, 1, 5};
  max_pool2d_forward(s, row_nans.data(), y.data(), &at);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(at, 1);
}

// ================================ bias ================================

TEST(Bias, GradRowsSumsInRowOrder) {
  for (auto [n, m] : {std::pair<int64_t, int64_t>{1, 1}, {7, 10}, {256, 128}, {33, 5}}) {
    Rng rng(7);
    const Floats dy = rng.floats(n * m);
    Floats db(m, kNaN);
    bias_grad_rows(n, m, dy.data(), db.data());
    Doubles want(m);
    Floats in_order(m, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        want[j] += dy[i * m + j];
        in_order[j] += dy[i * m + j];
      }
    }
    EXPECT_TRUE(all_close("bias_grad_rows n=" + std::to_string(n), db, want, kSum));
    EXPECT_TRUE(same_bits(db, in_order)) << "bias_grad_rows must add rows in i order";
  }
}

// ================================ softmax cross-entropy ================================

template <class Label>
void check_softmax_ce(int64_t n, int64_t m, const Floats& z, const std::vector<Label>& labels,
                      const Floats& dloss, const std::string& what) {
  Floats loss(n, kNaN), dz(n * m, kNaN);
  softmax_ce_forward(n, m, z.data(), labels.data(), loss.data());
  softmax_ce_backward(n, m, z.data(), labels.data(), dloss.data(), dz.data());
  Doubles want_loss, want_dz;
  ref_softmax_ce(n, m, z, labels, dloss, &want_loss, &want_dz);
  EXPECT_TRUE(all_close("softmax_ce_forward " + what, loss, want_loss, kSum));
  EXPECT_TRUE(all_close("softmax_ce_backward " + what, dz, want_dz, kSum));
}

TEST(SoftmaxCe, MatchesReferenceForBothLabelTypes) {
  const int64_t n = 150, m = 10;  // several row blocks, LeNet's 10 classes
  Rng rng(8);
  const Floats z = rng.floats(n * m, -5.0f, 5.0f), dloss = rng.floats(n, 0.5f, 2.0f);
  std::vector<int64_t> labels64(n);
  std::vector<int32_t> labels32(n);
  for (int64_t i = 0; i < n; ++i) {
    labels64[i] = static_cast<int64_t>(rng.uniform(0.0f, 1.0f) * m) % m;
    labels32[i] = static_cast<int32_t>(labels64[i]);
  }
  check_softmax_ce(n, m, z, labels64, dloss, "int64");
  check_softmax_ce(n, m, z, labels32, dloss, "int32");
  check_softmax_ce(1, 1, Floats{3.0f}, std::vector<int64_t>{0}, Floats{1.0f}, "one class");
}

TEST(SoftmaxCe, StableForLogitsNearPlusMinus1000) {
  const int64_t m = 4;
  const Floats z = {1000.0f,  1001.0f,  999.5f,  1000.25f,  // all large: naive exp overflows
                    -1000.0f, -1001.0f, -999.0f, -1000.5f,  // all very negative: naive sum is 0
                    1000.0f,  -1000.0f, 0.0f,    999.0f,    // huge spread: loss ~2000 for label 1
                    1000.0f,  1000.0f,  1000.0f, 1000.0f};  // ties: loss = log(4)
  const std::vector<int64_t> labels = {1, 0, 1, 3};
  const Floats dloss = {1.0f, 1.0f, 1.0f, 1.0f};
  check_softmax_ce(4, m, z, labels, dloss, "large logits");
  Floats loss(4);
  softmax_ce_forward(4, m, z.data(), labels.data(), loss.data());
  for (float l : loss) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NEAR(loss[3], std::log(4.0), 1e-6);
}

TEST(SoftmaxCe, TinyLossKeepsItsDigits) {
  // The label's logit beats the rest by 30: loss = log1p(9 e^-30) ~ 8.4e-13, which
  // log(sum) would round to 0 in float.
  Floats z(10, 0.0f);
  z[2] = 30.0f;
  const std::vector<int64_t> labels = {2};
  Floats loss(1);
  softmax_ce_forward(1, 10, z.data(), labels.data(), loss.data());
  EXPECT_NEAR(loss[0], 9.0 * std::exp(-30.0), 1e-4 * 9.0 * std::exp(-30.0));
}

template <class Label>
void expect_bad_label_throws(Label bad, int64_t row) {
  const int64_t n = 5, m = 10;
  Floats z(n * m, 0.5f), dloss(n, 1.0f), loss(n, 7.0f), dz(n * m, 7.0f);
  std::vector<Label> labels(n, Label{1});
  labels[row] = bad;
  const std::string want = "label " + std::to_string(static_cast<int64_t>(bad)) + " in row " +
                           std::to_string(row) + " is out of range for 10 classes";
  try {
    softmax_ce_forward(n, m, z.data(), labels.data(), loss.data());
    ADD_FAILURE() << "softmax_ce_forward accepted label " << static_cast<int64_t>(bad);
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("softmax_ce_forward: " + want), std::string::npos)
        << e.what();
  }
  try {
    softmax_ce_backward(n, m, z.data(), labels.data(), dloss.data(), dz.data());
    ADD_FAILURE() << "softmax_ce_backward accepted label " << static_cast<int64_t>(bad);
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("softmax_ce_backward: " + want), std::string::npos)
        << e.what();
  }
  // Checked before anything is written.
  EXPECT_EQ(loss, Floats(n, 7.0f));
  EXPECT_EQ(dz, Floats(n * m, 7.0f));
}

TEST(SoftmaxCe, OutOfRangeLabelThrowsNamingLabelRowAndClasses) {
  expect_bad_label_throws<int64_t>(10, 3);
  expect_bad_label_throws<int64_t>(-1, 0);
  expect_bad_label_throws<int64_t>(int64_t{1} << 40, 4);
  expect_bad_label_throws<int32_t>(10, 2);
  expect_bad_label_throws<int32_t>(-7, 4);
}

// ================================ argmax ================================

TEST(Argmax, FirstMaximumWinsAndNaNCountsAsMaximum) {
  const Floats x = {1,    3,  3,    2,   // tie: first wins
                    -4,   -2, -3,   -2,  // negatives, tie
                    5,    5,  5,    5,   // all equal
                    0,    9,  kNaN, 9,   // NaN wins, as in NumPy
                    kNaN, 1,  2,    3};  // NaN first
  std::vector<int64_t> out(5, -1);
  argmax_rows(5, 4, x.data(), out.data());
  EXPECT_EQ(out, (std::vector<int64_t>{1, 1, 0, 2, 0}));

  const Floats single = {-1.0f, 2.0f};
  std::vector<int64_t> out1(2, -1);
  argmax_rows(2, 1, single.data(), out1.data());
  EXPECT_EQ(out1, (std::vector<int64_t>{0, 0}));
}

TEST(Argmax, MatchesReferenceOnRandomRows) {
  const int64_t n = 300, m = 10;
  Rng rng(9);
  const Floats x = rng.floats(n * m);
  std::vector<int64_t> out(n, -1);
  argmax_rows(n, m, x.data(), out.data());
  for (int64_t i = 0; i < n; ++i) {
    const auto row = x.begin() + i * m;
    EXPECT_EQ(out[i], std::max_element(row, row + m) - row) << "row " << i;
  }
}

// ================================ batch norm ================================
// x (N, C, HW): the CPU kernels against double loops over each channel's N*HW values, training
// and evaluation; HW not a multiple of the 16 reduction lanes, batch 1, one channel, HW = 1.

struct BnCase {
  const char* name;
  int64_t N, C, HW;
  float loc;  // the data's mean (its spread is 1)
};

void PrintTo(const BnCase& c, std::ostream* os) { *os << c.name; }

class BatchNormTest : public ::testing::TestWithParam<BnCase> {};

TEST_P(BatchNormTest, KernelsMatchDoubleLoops) {
  const BnCase c = GetParam();
  const int64_t n = c.N * c.C * c.HW, count = c.N * c.HW;
  const float eps = 1e-5f;
  Rng data(21);
  Floats x = data.floats(n), dy = data.floats(n), gamma = data.floats(c.C, 0.5f, 1.5f),
         beta = data.floats(c.C);
  for (float& v : x) v += c.loc;
  auto at = [&](int64_t i, int64_t ch, int64_t j) { return (i * c.C + ch) * c.HW + j; };

  Doubles mean(c.C), var(c.C), sum_dy(c.C), sum_dy_xhat(c.C), y(n), dx_train(n), dx_eval(n);
  for (int64_t ch = 0; ch < c.C; ++ch) {
    double s = 0.0, q = 0.0, g = 0.0, gx = 0.0;
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t j = 0; j < c.HW; ++j) s += x[at(i, ch, j)];
    mean[ch] = s / count;
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t j = 0; j < c.HW; ++j) q += std::pow(x[at(i, ch, j)] - mean[ch], 2);
    var[ch] = q / count;
    // The other kernels take the statistics as float: the reference uses those same values, so
    // only the kernels' own rounding is measured (|mean| >> std would otherwise dominate).
    const double mf = static_cast<float>(mean[ch]), vf = static_cast<float>(var[ch]);
    const double invstd = 1.0 / std::sqrt(vf + eps);
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t j = 0; j < c.HW; ++j) {
        const double xhat = (x[at(i, ch, j)] - mf) * invstd;
        y[at(i, ch, j)] = xhat * gamma[ch] + beta[ch];
        g += dy[at(i, ch, j)];
        gx += dy[at(i, ch, j)] * xhat;
      }
    sum_dy[ch] = g;
    sum_dy_xhat[ch] = gx;
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t j = 0; j < c.HW; ++j) {
        const int64_t k = at(i, ch, j);
        const double xhat = (x[k] - mf) * invstd;
        dx_train[k] = gamma[ch] * invstd * (dy[k] - g / count - xhat * gx / count);
        dx_eval[k] = gamma[ch] * invstd * dy[k];
      }
  }

  Floats m(c.C), v(c.C), out(n, kNaN), sdy(c.C), sdyx(c.C), dxt(n, kNaN), dxe(n, kNaN);
  batch_norm_stats(c.N, c.C, c.HW, x.data(), m.data(), v.data());
  EXPECT_TRUE(all_close("batch_norm_stats mean", m, mean, kElementwise));
  EXPECT_TRUE(all_close("batch_norm_stats var", v, var, kSum));
  Floats mf(mean.begin(), mean.end()), vf(var.begin(), var.end());
  batch_norm_forward(c.N, c.C, c.HW, x.data(), mf.data(), vf.data(), gamma.data(), beta.data(),
                     eps, out.data());
  EXPECT_TRUE(all_close("batch_norm_forward y", out, y, kSum));
  batch_norm_backward_reduce(c.N, c.C, c.HW, x.data(), dy.data(), mf.data(), vf.data(), eps,
                             sdy.data(), sdyx.data());
  EXPECT_TRUE(all_close("batch_norm_backward_reduce sum_dy", sdy, sum_dy, kSum));
  EXPECT_TRUE(all_close("batch_norm_backward_reduce sum_dy_xhat", sdyx, sum_dy_xhat, kSum));
  batch_norm_backward(c.N, c.C, c.HW, x.data(), dy.data(), mf.data(), vf.data(), gamma.data(),
                      sdy.data(), sdyx.data(), static_cast<double>(count), eps, true, dxt.data());
  EXPECT_TRUE(all_close("batch_norm_backward dx (training)", dxt, dx_train, kSum));
  batch_norm_backward(c.N, c.C, c.HW, x.data(), dy.data(), mf.data(), vf.data(), gamma.data(),
                      nullptr, nullptr, static_cast<double>(count), eps, false, dxe.data());
  EXPECT_TRUE(all_close("batch_norm_backward dx (evaluation)", dxe, dx_eval, kSum));
}

const BnCase kBnCases[] = {
    {"n2_c3_hw35", 2, 3, 35, 0.0f},   {"batch1_hw49", 1, 4, 49, 0.5f},
    {"one_channel_hw16", 5, 1, 16, -1.0f}, {"nc_2d_hw1", 7, 3, 1, 0.0f},
    {"mean_1e3_over_std", 3, 2, 50, 1000.0f}, {"resnet_like_c64_hw196", 2, 64, 196, 0.0f},
};
INSTANTIATE_TEST_SUITE_P(Shapes, BatchNormTest, ::testing::ValuesIn(kBnCases),
                         [](const ::testing::TestParamInfo<BnCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(BatchNorm, AffineFalseMeansGammaOneBetaZero) {
  const int64_t N = 3, C = 2, HW = 9, n = N * C * HW;
  Rng data(5);
  const Floats x = data.floats(n), dy = data.floats(n), mean = data.floats(C),
               var = data.floats(C, 0.5f, 2.0f), sdy = data.floats(C), sdyx = data.floats(C);
  const Floats ones(C, 1.0f), zeros(C, 0.0f);
  Floats a(n), b(n), da(n), db(n);
  batch_norm_forward(N, C, HW, x.data(), mean.data(), var.data(), nullptr, nullptr, 1e-3f,
                     a.data());
  batch_norm_forward(N, C, HW, x.data(), mean.data(), var.data(), ones.data(), zeros.data(),
                     1e-3f, b.data());
  EXPECT_TRUE(same_bits(a, b));
  batch_norm_backward(N, C, HW, x.data(), dy.data(), mean.data(), var.data(), nullptr, sdy.data(),
                      sdyx.data(), 27.0, 1e-3f, true, da.data());
  batch_norm_backward(N, C, HW, x.data(), dy.data(), mean.data(), var.data(), ones.data(),
                      sdy.data(), sdyx.data(), 27.0, 1e-3f, true, db.data());
  EXPECT_TRUE(same_bits(da, db));
}

// ================================ determinism ================================

// Every kernel with parallel work, run at several thread counts: the bits must not change.
// (With the serial stand-in for the pool every count runs serially; with the real pool, or a
// test pool that runs indices in reverse on several threads, this is the contract's check.)
TEST(Determinism, BitsDoNotDependOnThreadCount) {
  const Conv2dShape convs[] = {{19, 20, 13, 13, 50, 5, 5, 1, 0},
                               {37, 1, 28, 28, 20, 3, 3, 1, 0},
                               {21, 3, 9, 11, 5, 3, 3, 2, 1}};
  const PoolShape pool{7, 20, 26, 26, 2, 2, 2, 2};

  auto run_all = [&]() {
    std::vector<Floats> out;
    for (const Conv2dShape& s : convs) {
      Rng data(13);
      const Floats x = data.floats(numel(s)), w = data.floats(w_numel(s)), b = data.floats(s.K),
                   dy = data.floats(out_numel(s));
      Floats y(out_numel(s)), dx(numel(s)), dw(w_numel(s)), db(s.K);
      conv2d_forward(s, x.data(), w.data(), b.data(), y.data());
      conv2d_backward(s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data());
      out.insert(out.end(), {y, dx, dw, db});
    }
    Rng data(14);
    const Floats px = data.floats(pool.N * pool.C * pool.H * pool.W),
                 pdy = data.floats(pool.N * pool.C * pool.P() * pool.Q());
    Floats py(pdy.size()), pdx(px.size());
    avg_pool2d_forward(pool.N, pool.C, pool.H, pool.W, pool.kh, pool.kw, pool.sh, pool.sw,
                       px.data(), py.data());
    avg_pool2d_backward(pool.N, pool.C, pool.H, pool.W, pool.kh, pool.kw, pool.sh, pool.sw,
                        pdy.data(), pdx.data());
    out.insert(out.end(), {py, pdx});

    const int64_t n = 200, m = 10;
    const Floats z = data.floats(n * m, -5.0f, 5.0f), dloss = data.floats(n);
    std::vector<int64_t> labels(n);
    for (int64_t i = 0; i < n; ++i) labels[i] = i % m;
    Floats loss(n), dz(n * m);
    softmax_ce_forward(n, m, z.data(), labels.data(), loss.data());
    softmax_ce_backward(n, m, z.data(), labels.data(), dloss.data(), dz.data());
    out.insert(out.end(), {loss, dz});

    const int64_t bn = 9, bc = 5, bhw = 37;
    const Floats bx = data.floats(bn * bc * bhw), bdy = data.floats(bn * bc * bhw),
                 bg = data.floats(bc);
    Floats bm(bc), bv(bc), by(bx.size()), bs1(bc), bs2(bc), bdx(bx.size());
    batch_norm_stats(bn, bc, bhw, bx.data(), bm.data(), bv.data());
    batch_norm_forward(bn, bc, bhw, bx.data(), bm.data(), bv.data(), bg.data(), nullptr, 1e-5f,
                       by.data());
    batch_norm_backward_reduce(bn, bc, bhw, bx.data(), bdy.data(), bm.data(), bv.data(), 1e-5f,
                               bs1.data(), bs2.data());
    batch_norm_backward(bn, bc, bhw, bx.data(), bdy.data(), bm.data(), bv.data(), bg.data(),
                        bs1.data(), bs2.data(), static_cast<double>(bn * bhw), 1e-5f, true,
                        bdx.data());
    out.insert(out.end(), {bm, bv, by, bs1, bs2, bdx});
    return out;
  };

  std::vector<Floats> serial;
  {
    ThreadCount one(1);
    serial = run_all();
  }
  for (int threads : {2, 3, 4}) {
    ThreadCount count(threads);
    const std::vector<Floats> parallel = run_all();
    ASSERT_EQ(parallel.size(), serial.size());
    for (size_t i = 0; i < serial.size(); ++i) {
      EXPECT_TRUE(same_bits(parallel[i], serial[i]))
          << "output " << i << " differs between 1 and " << threads << " threads";
    }
  }
}

}  // namespace
