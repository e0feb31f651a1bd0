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
#include "kernels_test_util.h"

namespace {

using namespace mgpu::ops::cpu;
using namespace mgpu_test;  // the kernel tests' shared helpers (kernels_test_util.h)
using mgpu::ops::Conv2dShape;

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

}  // namespace
