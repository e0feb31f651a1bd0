// tests/cpp/test_kernels_loss_norm.cpp -- the raw CPU kernels of the model's tail (bias gradient,
// softmax cross-entropy, argmax) and batch norm against loops in double precision, the label
// checks, and the contract that the bits do not depend on the thread count.
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
