// tests/cpp/test_cpu_isa.cpp -- the two instruction-set paths of the CPU kernels (cpu_isa.h):
// cpu::avx2 and cpu::avx512 called directly on the same data give the same bits, on every conv
// algorithm (direct, lanes, im2col) with tails in every direction, the fused relu-pool kernels,
// pooling, the loss and the bias sums, batch norm, the elementwise add and the SGD step. (Both
// are checked against float64 references by test_kernels.cpp, which ctest runs once per path.)
// Skipped in mgpu_cpp_tests where the CPU lacks AVX-512; mgpu_avx512_emulated_tests runs them
// everywhere, with the AVX-512 path compiled for AVX2 (tests/cpp/avx512_emulated.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "ops/cpu_isa.h"

namespace {

using namespace mgpu::ops::cpu;
using mgpu::ops::Conv2dShape;
using Floats = std::vector<float>;
using Bytes = std::vector<uint8_t>;

Floats random_floats(size_t n, uint64_t seed) {
  Floats v(n);
  for (float& e : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    e = static_cast<float>(static_cast<int64_t>(seed >> 40) - (int64_t{1} << 23)) /
        static_cast<float>(int64_t{1} << 23);
  }
  return v;
}

template <class T>
::testing::AssertionResult same_bits(const char* what, const std::vector<T>& a,
                                     const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": first difference at index " << i << ": avx2 "
                                           << +a[i] << ", avx512 " << +b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// Whether the avx512 kernels run here: on a CPU with AVX-512, or, in mgpu_avx512_emulated_tests,
// anywhere (the AVX-512 path compiled for AVX2: tests/cpp/avx512_emulated.h).
bool avx512_runs() {
#if defined(MGPU_AVX512_EMULATED)
  return true;
#else
  return cpu_has_avx512();
#endif
}

struct IsaCase {
  const char* name;
  Conv2dShape s;
  int64_t pool;
};
void PrintTo(const IsaCase& c, std::ostream* os) { *os << c.name; }

// Direct path (C*R*S <= 16, Q >= 16): one chunk, a last chunk overlapping the one before, odd P
// and Q (one channel of 3x3 taps, whose rows the AVX2 path shares, and two channels); lane path:
// LeNet's conv2, a short last block, tile tails, outputs narrower than the kernel; im2col:
// padding and strides.
const IsaCase kCases[] = {
    {"direct_lenet_conv1", {37, 1, 28, 28, 20, 3, 3, 1, 0}, 2},
    {"direct_q16", {2, 1, 18, 18, 4, 3, 3, 1, 0}, 2},
    {"direct_c2_odd_pq", {10, 2, 11, 19, 4, 2, 3, 1, 0}, 2},
    {"direct_c1_3x3_odd_pq", {3, 1, 21, 19, 5, 3, 3, 1, 0}, 2},
    {"direct_wide_pool3", {3, 1, 21, 37, 3, 3, 3, 1, 0}, 3},
    {"direct_16_taps", {5, 16, 4, 40, 5, 1, 1, 1, 0}, 2},
    {"lanes_lenet_conv2", {35, 20, 13, 13, 50, 5, 5, 1, 0}, 2},
    {"lanes_tails_batch33", {33, 3, 8, 11, 7, 3, 4, 1, 0}, 2},
    {"lanes_odd_pq", {17, 3, 12, 13, 6, 4, 4, 1, 0}, 2},
    {"lanes_q_below_s", {3, 2, 6, 6, 3, 5, 5, 1, 0}, 1},
    {"lanes_1x17", {18, 1, 3, 20, 2, 1, 17, 1, 0}, 2},
    {"im2col_pad1", {19, 3, 20, 22, 4, 3, 3, 1, 1}, 2},
    {"im2col_stride2", {9, 2, 9, 11, 5, 3, 3, 2, 1}, 2},
};

class CpuIsaTest : public ::testing::TestWithParam<IsaCase> {
 protected:
  void SetUp() override {
    if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  }
};

TEST_P(CpuIsaTest, ConvForwardAndBackwardSameBits) {
  const Conv2dShape s = GetParam().s;
  const int64_t nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S;
  const int64_t ny = s.N * s.K * s.P() * s.Q();
  const Floats x = random_floats(nx, 1), w = random_floats(nw, 2), b = random_floats(s.K, 3);
  const Floats dy = random_floats(ny, 4);
  Floats y[2] = {Floats(ny), Floats(ny)}, dx[2] = {Floats(nx), Floats(nx)};
  Floats dw[2] = {Floats(nw), Floats(nw)}, db[2] = {Floats(s.K), Floats(s.K)};
  avx2::conv2d_forward(s, x.data(), w.data(), b.data(), y[0].data());
  avx512::conv2d_forward(s, x.data(), w.data(), b.data(), y[1].data());
  avx2::conv2d_backward(s, x.data(), w.data(), dy.data(), dx[0].data(), dw[0].data(), db[0].data());
  avx512::conv2d_backward(s, x.data(), w.data(), dy.data(), dx[1].data(), dw[1].data(),
                          db[1].data());
  EXPECT_TRUE(same_bits("y", y[0], y[1]));
  EXPECT_TRUE(same_bits("dx", dx[0], dx[1]));
  EXPECT_TRUE(same_bits("dw", dw[0], dw[1]));
  EXPECT_TRUE(same_bits("db", db[0], db[1]));
}

TEST_P(CpuIsaTest, FusedReluPoolSameBits) {
  const Conv2dShape s = GetParam().s;
  const int64_t pool = GetParam().pool;
  const int64_t nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S;
  const int64_t ny = s.N * s.K * s.P() * s.Q();
  const int64_t np = s.N * s.K * (s.P() / pool) * (s.Q() / pool);
  const Floats x = random_floats(nx, 5), w = random_floats(nw, 6), b = random_floats(s.K, 7);
  const Floats dpooled = random_floats(np, 8);
  Bytes mask[2] = {Bytes(ny), Bytes(ny)};
  Floats pooled[2] = {Floats(np), Floats(np)}, dx[2] = {Floats(nx), Floats(nx)};
  Floats dw[2] = {Floats(nw), Floats(nw)}, db[2] = {Floats(s.K), Floats(s.K)};
  avx2::conv2d_relu_pool_forward(s, pool, x.data(), w.data(), b.data(), mask[0].data(),
                                 pooled[0].data(), false, false);
  avx512::conv2d_relu_pool_forward(s, pool, x.data(), w.data(), b.data(), mask[1].data(),
                                   pooled[1].data(), false, false);
  EXPECT_TRUE(same_bits("mask", mask[0], mask[1]));
  EXPECT_TRUE(same_bits("pooled", pooled[0], pooled[1]));
  // The first layer's backward skips dx (null), as LeNet's does; the others compute it.
  const bool need_dx = s.C > 1;
  avx2::conv2d_relu_pool_backward(s, pool, x.data(), w.data(), mask[0].data(), dpooled.data(),
                                  need_dx ? dx[0].data() : nullptr, dw[0].data(), db[0].data(),
                                  false, false);
  avx512::conv2d_relu_pool_backward(s, pool, x.data(), w.data(), mask[0].data(), dpooled.data(),
                                    need_dx ? dx[1].data() : nullptr, dw[1].data(), db[1].data(),
                                    false, false);
  EXPECT_TRUE(same_bits("dx", dx[0], dx[1]));
  EXPECT_TRUE(same_bits("dw", dw[0], dw[1]));
  EXPECT_TRUE(same_bits("db", db[0], db[1]));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuIsaTest, ::testing::ValuesIn(kCases),
                         [](const auto& p) { return std::string(p.param.name); });

// Winograd F(4x4, 3x3) (MGPU_CONV_ALGO=winograd): ResNet-18's 4x4 layer, tiles overhanging the
// image (7x7, 5x6), a 1x1 image, pad 0 and 2, dx skipped, for the fused forward
// (winograd_fused.cpp) output channels that are no multiple of either path's register tile
// (13, 171), a short last block of tiles and blocks of 64 tiles (176 -> 171 channels), and the
// weight gradient's blocks and register-tile tails; against float64 in
// tests/test_conv_winograd.py.
TEST(CpuIsa, WinogradSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  const char* old = std::getenv("MGPU_CONV_ALGO");
  const std::string saved = old ? old : "";
  setenv("MGPU_CONV_ALGO", "winograd", 1);
  for (const Conv2dShape& s : {Conv2dShape{3, 64, 4, 4, 32, 3, 3, 1, 1},
                               Conv2dShape{2, 5, 7, 7, 6, 3, 3, 1, 1},
                               Conv2dShape{1, 3, 5, 6, 2, 3, 3, 1, 2},
                               Conv2dShape{2, 2, 1, 1, 3, 3, 3, 1, 1},
                               Conv2dShape{2, 4, 9, 11, 3, 3, 3, 1, 0},
                               Conv2dShape{3, 19, 11, 13, 13, 3, 3, 1, 1},
                               Conv2dShape{17, 176, 7, 7, 171, 3, 3, 1, 1},
                               // dw: two blocks of images (28 + 2), register-tile tails in c and k
                               Conv2dShape{30, 17, 9, 9, 13, 3, 3, 1, 1},
                               Conv2dShape{2, 80, 6, 6, 70, 3, 3, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "C=" << s.C << " H=" << s.H << " W=" << s.W
                                      << " K=" << s.K << " pad=" << s.pad);
    const int64_t nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * 9, ny = s.N * s.K * s.P() * s.Q();
    const Floats x = random_floats(nx, 21), w = random_floats(nw, 22), b = random_floats(s.K, 23);
    const Floats dy = random_floats(ny, 24);
    Floats y[2] = {Floats(ny), Floats(ny)}, dx[2] = {Floats(nx), Floats(nx)};
    Floats dw[2] = {Floats(nw), Floats(nw)}, db[2] = {Floats(s.K), Floats(s.K)};
    Floats dw_only[2] = {Floats(nw), Floats(nw)};
    for (int path = 0; path < 2; ++path) {
      auto fwd = path ? avx512::conv2d_forward : avx2::conv2d_forward;
      auto bwd = path ? avx512::conv2d_backward : avx2::conv2d_backward;
      const size_t p = static_cast<size_t>(path);
      fwd(s, x.data(), w.data(), b.data(), y[p].data());
      bwd(s, x.data(), w.data(), dy.data(), dx[p].data(), dw[p].data(), db[p].data());
      bwd(s, x.data(), w.data(), dy.data(), nullptr, dw_only[p].data(), nullptr);
    }
    EXPECT_TRUE(same_bits("y", y[0], y[1]));
    EXPECT_TRUE(same_bits("dx", dx[0], dx[1]));
    EXPECT_TRUE(same_bits("dw", dw[0], dw[1]));
    EXPECT_TRUE(same_bits("db", db[0], db[1]));
    EXPECT_TRUE(same_bits("dw without dx", dw_only[0], dw[0]));
  }
  if (old) {
    setenv("MGPU_CONV_ALGO", saved.c_str(), 1);
  } else {
    unsetenv("MGPU_CONV_ALGO");
  }
}

TEST(CpuIsa, MaxPoolSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  // Rows of 37 floats: two 16-float vectors and a tail on the AVX-512 path, four 8-float ones and
  // a tail on the AVX2 path; values on a coarse grid (ties) with pairs of neighbouring NaNs.
  for (const mgpu::ops::MaxPoolShape& s : {mgpu::ops::MaxPoolShape{3, 5, 13, 37, 3, 3, 2, 2, 1, 1},
                                          mgpu::ops::MaxPoolShape{2, 3, 9, 17, 2, 3, 1, 2, 1, 0}}) {
    Floats x = random_floats(s.N * s.C * s.H * s.W, 12);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(static_cast<int>(x[i] * 3.0f));
      if (i % 29 < 2) x[i] = std::numeric_limits<float>::quiet_NaN();
    }
    const int64_t ny = s.N * s.C * s.P() * s.Q();
    const Floats dy = random_floats(ny, 13);
    Floats y[2] = {Floats(ny), Floats(ny)}, dx[2] = {Floats(x.size()), Floats(x.size())};
    std::vector<int32_t> at[2] = {std::vector<int32_t>(ny), std::vector<int32_t>(ny)};
    avx2::max_pool2d_forward(s, x.data(), y[0].data(), at[0].data());
    avx512::max_pool2d_forward(s, x.data(), y[1].data(), at[1].data());
    avx2::max_pool2d_backward(s, at[0].data(), dy.data(), dx[0].data());
    avx512::max_pool2d_backward(s, at[1].data(), dy.data(), dx[1].data());
    EXPECT_TRUE(same_bits("max_pool y", y[0], y[1]));
    EXPECT_TRUE(same_bits("max_pool indices", at[0], at[1]));
    EXPECT_TRUE(same_bits("max_pool dx", dx[0], dx[1]));
  }
}

TEST(CpuIsa, PoolLossAndBiasSumsSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  const int64_t N = 7, C = 5, H = 13, W = 11, n = 37, m = 10;
  const Floats x = random_floats(N * C * H * W, 9);
  const int64_t P = (H - 3) / 2 + 1, Q = (W - 3) / 2 + 1;
  Floats y[2] = {Floats(N * C * P * Q), Floats(N * C * P * Q)};
  Floats dx[2] = {Floats(x.size()), Floats(x.size())};
  for (int path = 0; path < 2; ++path) {
    auto fwd = path ? avx512::avg_pool2d_forward : avx2::avg_pool2d_forward;
    auto bwd = path ? avx512::avg_pool2d_backward : avx2::avg_pool2d_backward;
    fwd(N, C, H, W, 3, 3, 2, 2, x.data(), y[path].data());
    bwd(N, C, H, W, 3, 3, 2, 2, y[path].data(), dx[path].data());
  }
  EXPECT_TRUE(same_bits("avg_pool y", y[0], y[1]));
  EXPECT_TRUE(same_bits("avg_pool dx", dx[0], dx[1]));

  const Floats z = random_floats(n * m, 10), dloss = random_floats(n, 11);
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = (i * 7) % m;
  Floats loss[2] = {Floats(n), Floats(n)}, dz[2] = {Floats(n * m), Floats(n * m)};
  Floats db[2] = {Floats(m), Floats(m)};
  avx2::softmax_ce_forward(n, m, z.data(), labels.data(), loss[0].data());
  avx512::softmax_ce_forward(n, m, z.data(), labels.data(), loss[1].data());
  avx2::softmax_ce_backward(n, m, z.data(), labels.data(), dloss.data(), dz[0].data());
  avx512::softmax_ce_backward(n, m, z.data(), labels.data(), dloss.data(), dz[1].data());
  avx2::bias_grad_rows(n, m, z.data(), db[0].data());
  avx512::bias_grad_rows(n, m, z.data(), db[1].data());
  EXPECT_TRUE(same_bits("loss", loss[0], loss[1]));
  EXPECT_TRUE(same_bits("dlogits", dz[0], dz[1]));
  EXPECT_TRUE(same_bits("bias grad", db[0], db[1]));
}

// Batch norm (ResNet-18's): the statistics, forward, the backward's sums and dx, with and without
// the affine parameters, HW with and without a tail of the 16 lanes, and (N, C) inputs (HW = 1).
TEST(CpuIsa, BatchNormSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  struct Case {
    int64_t N, C, HW;
  };
  for (const Case c : {Case{4, 3, 49}, Case{3, 5, 64}, Case{9, 7, 1}, Case{2, 2, 17}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C << " HW=" << c.HW);
    const size_t n = static_cast<size_t>(c.N * c.C * c.HW), C = static_cast<size_t>(c.C);
    Floats x = random_floats(n, 12);
    for (float& e : x) e = 3.0f + 2.0f * e;  // mean well away from 0
    const Floats dy = random_floats(n, 13), gamma = random_floats(C, 14);
    const Floats beta = random_floats(C, 15);
    Floats mean[2] = {Floats(C), Floats(C)}, var[2] = {Floats(C), Floats(C)};
    Floats y[2] = {Floats(n), Floats(n)}, y0[2] = {Floats(n), Floats(n)};
    Floats sdy[2] = {Floats(C), Floats(C)}, sdx[2] = {Floats(C), Floats(C)};
    Floats dx[2] = {Floats(n), Floats(n)}, dxe[2] = {Floats(n), Floats(n)};
    for (int path = 0; path < 2; ++path) {
      auto stats = path ? avx512::batch_norm_stats : avx2::batch_norm_stats;
      auto fwd = path ? avx512::batch_norm_forward : avx2::batch_norm_forward;
      auto reduce = path ? avx512::batch_norm_backward_reduce : avx2::batch_norm_backward_reduce;
      auto bwd = path ? avx512::batch_norm_backward : avx2::batch_norm_backward;
      const size_t p = static_cast<size_t>(path);
      stats(c.N, c.C, c.HW, x.data(), mean[p].data(), var[p].data());
      fwd(c.N, c.C, c.HW, x.data(), mean[p].data(), var[p].data(), gamma.data(), beta.data(),
          1e-5f, y[p].data());
      fwd(c.N, c.C, c.HW, x.data(), mean[p].data(), var[p].data(), nullptr, nullptr, 1e-5f,
          y0[p].data());
      reduce(c.N, c.C, c.HW, x.data(), dy.data(), mean[p].data(), var[p].data(), 1e-5f,
             sdy[p].data(), sdx[p].data());
      bwd(c.N, c.C, c.HW, x.data(), dy.data(), mean[p].data(), var[p].data(), gamma.data(),
          sdy[p].data(), sdx[p].data(), static_cast<double>(c.N * c.HW), 1e-5f, true,
          dx[p].data());
      bwd(c.N, c.C, c.HW, x.data(), dy.data(), mean[p].data(), var[p].data(), nullptr, nullptr,
          nullptr, 0.0, 1e-5f, false, dxe[p].data());
    }
    EXPECT_TRUE(same_bits("mean", mean[0], mean[1]));
    EXPECT_TRUE(same_bits("var", var[0], var[1]));
    EXPECT_TRUE(same_bits("y", y[0], y[1]));
    EXPECT_TRUE(same_bits("y without gamma, beta", y0[0], y0[1]));
    EXPECT_TRUE(same_bits("sum_dy", sdy[0], sdy[1]));
    EXPECT_TRUE(same_bits("sum_dy_xhat", sdx[0], sdx[1]));
    EXPECT_TRUE(same_bits("dx", dx[0], dx[1]));
    EXPECT_TRUE(same_bits("dx in evaluation", dxe[0], dxe[1]));
  }
}

// Batch norm + relu (+ add), the fused step's layers: forward with and without the shortcut, the
// masked sums and dx with the shortcut's gradient, HW with and without a tail of the lanes.
TEST(CpuIsa, BatchNormActSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  struct Case {
    int64_t N, C, HW;
  };
  for (const Case c : {Case{4, 3, 49}, Case{3, 5, 64}, Case{9, 7, 1}, Case{2, 1, 17},
                       Case{3, 37, 16}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C << " HW=" << c.HW);
    const size_t n = static_cast<size_t>(c.N * c.C * c.HW), C = static_cast<size_t>(c.C);
    const Floats x = random_floats(n, 22), sc = random_floats(n, 23), dy = random_floats(n, 24);
    const Floats gamma = random_floats(C, 25), beta = random_floats(C, 26);
    Floats mean(C), var(C);
    avx2::batch_norm_stats(c.N, c.C, c.HW, x.data(), mean.data(), var.data());
    Floats y[2] = {Floats(n), Floats(n)}, ya[2] = {Floats(n), Floats(n)};
    Floats sdz[2] = {Floats(C), Floats(C)}, sdx[2] = {Floats(C), Floats(C)};
    Floats dx[2] = {Floats(n), Floats(n)}, dsc[2] = {Floats(n), Floats(n)};
    Floats fsdz[2] = {Floats(C), Floats(C)}, fsdx[2] = {Floats(C), Floats(C)};
    Floats fdx[2] = {Floats(n), Floats(n)}, fdsc[2] = {Floats(n), Floats(n)};
    for (int path = 0; path < 2; ++path) {
      auto fwd = path ? avx512::batch_norm_act_forward : avx2::batch_norm_act_forward;
      auto reduce =
          path ? avx512::batch_norm_act_backward_reduce : avx2::batch_norm_act_backward_reduce;
      auto bwd = path ? avx512::batch_norm_act_backward : avx2::batch_norm_act_backward;
      const size_t p = static_cast<size_t>(path);
      fwd(c.N, c.C, c.HW, x.data(), mean.data(), var.data(), gamma.data(), beta.data(), nullptr,
          1e-5f, y[p].data());
      fwd(c.N, c.C, c.HW, x.data(), mean.data(), var.data(), gamma.data(), beta.data(), sc.data(),
          1e-5f, ya[p].data());
      reduce(c.N, c.C, c.HW, x.data(), ya[p].data(), dy.data(), mean.data(), var.data(), 1e-5f,
             sdz[p].data(), sdx[p].data());
      bwd(c.N, c.C, c.HW, x.data(), ya[p].data(), dy.data(), mean.data(), var.data(),
          gamma.data(), sdz[p].data(), sdx[p].data(), static_cast<double>(c.N * c.HW), 1e-5f,
          dx[p].data(), dsc[p].data());
      auto full = path ? avx512::batch_norm_backward_full : avx2::batch_norm_backward_full;
      full(c.N, c.C, c.HW, x.data(), ya[p].data(), dy.data(), mean.data(), var.data(),
           gamma.data(), 1e-5f, fsdz[p].data(), fsdx[p].data(), fdx[p].data(), fdsc[p].data());
    }
    // The whole backward in one kernel: the bits of the reduce and dx kernels, on each path.
    for (int p = 0; p < 2; ++p) {
      EXPECT_TRUE(same_bits("full: sum_dz", fsdz[p], sdz[p]));
      EXPECT_TRUE(same_bits("full: sum_dz_xhat", fsdx[p], sdx[p]));
      EXPECT_TRUE(same_bits("full: dx", fdx[p], dx[p]));
      EXPECT_TRUE(same_bits("full: dshortcut", fdsc[p], dsc[p]));
    }
    EXPECT_TRUE(same_bits("relu(bn(x))", y[0], y[1]));
    EXPECT_TRUE(same_bits("relu(bn(x) + shortcut)", ya[0], ya[1]));
    EXPECT_TRUE(same_bits("sum_dz", sdz[0], sdz[1]));
    EXPECT_TRUE(same_bits("sum_dz_xhat", sdx[0], sdx[1]));
    EXPECT_TRUE(same_bits("dx", dx[0], dx[1]));
    EXPECT_TRUE(same_bits("dshortcut", dsc[0], dsc[1]));
  }
}

// The residual add and the SGD step, over more than one parallel block and a vector tail, in
// place as the ops use them.
TEST(CpuIsa, AddAndSgdSameBits) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  const int64_t n = (1 << 15) + 37;
  const Floats a = random_floats(n, 16), b = random_floats(n, 17);
  Floats sum[2] = {a, a}, param[2] = {b, b};
  avx2::add_elements(n, sum[0].data(), b.data(), sum[0].data());
  avx512::add_elements(n, sum[1].data(), b.data(), sum[1].data());
  // The chapter's rule p -= scale * g: SgdStep over batch 1 with lr = scale.
  for (int path = 0; path < 2; ++path) {
    const mgpu::ops::SgdStep body{param[path].data(), a.data(), nullptr, 1.0f, 0.37f, 0.0f, 0.0f};
    if (path == 0) avx2::sgd_step(0, n, body);
    if (path == 1) avx512::sgd_step(0, n, body);
  }
  EXPECT_TRUE(same_bits("a + b", sum[0], sum[1]));
  EXPECT_TRUE(same_bits("sgd", param[0], param[1]));
  EXPECT_EQ(sum[0][5], a[5] + b[5]);
  EXPECT_FLOAT_EQ(param[0][n - 1], b[n - 1] - 0.37f * a[n - 1]);
}

// The SGD step in each of its forms (clip, weight decay, momentum plain, first, dampened, with
// and without Nesterov): both paths and the scalar body (compiled here, unvectorised) give the
// same bits, over a vector tail; and one element against the rule written out with fmaf.
TEST(CpuIsa, SgdStepSameBitsAsTheScalarBody) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  const int64_t n = 1000 + 13;
  const Floats grad = random_floats(n, 41), p0 = random_floats(n, 42), b0 = random_floats(n, 43);
  const float clip = 0.61f;
  for (int form = 0; form < 64; ++form) {
    const bool with_buf = form & 4;
    if (!with_buf && form >= 8) continue;  // first, dampening, nesterov need the buffer
    Floats p[3] = {p0, p0, p0}, b[3] = {b0, b0, b0};
    for (int path = 0; path < 3; ++path) {
      const mgpu::ops::SgdStep body{p[path].data(), grad.data(), with_buf ? b[path].data() : nullptr,
                                    8.0f, 0.013f, 0.9f, form & 2 ? 0.05f : 0.0f,
                                    form & 1 ? &clip : nullptr, form & 16 ? 0.3f : 0.0f,
                                    (form & 32) != 0, (form & 8) != 0};
      if (path == 0) avx2::sgd_step(0, n, body);
      if (path == 1) avx512::sgd_step(0, n, body);
      if (path == 2)
        for (int64_t i = 0; i < n; ++i) body(i);
    }
    const std::string f = "form " + std::to_string(form);
    for (int path = 1; path < 3; ++path) {
      EXPECT_TRUE(same_bits((f + " param").c_str(), p[0], p[path]));
      EXPECT_TRUE(same_bits((f + " buf").c_str(), b[0], b[path]));
    }
    // Element 7 by the documented rule.
    float g = grad[7] / 8.0f;
    if (form & 1) g = g * clip;
    if (form & 2) g = std::fma(p0[7], 0.05f, g);
    if (with_buf) {
      float bb = g;
      if (!(form & 8)) bb = std::fma(b0[7], 0.9f, form & 16 ? (1.0f - 0.3f) * g : g);
      EXPECT_EQ(b[0][7], bb) << f;
      g = form & 32 ? std::fma(0.9f, bb, g) : bb;
    }
    EXPECT_EQ(p[0][7], std::fma(-0.013f, g, p0[7])) << f;
  }
}

// The Adam step in each of its 16 forms (clip, AdamW's decay, Adam's L2, amsgrad): both paths
// and the scalar body (compiled here, unvectorised) give the same bits, over a vector tail.
TEST(CpuIsa, AdamStepSameBitsAsTheScalarBody) {
  if (!avx512_runs()) GTEST_SKIP() << "this CPU has no AVX-512: one path only";
  const int64_t n = 1000 + 13;
  const Floats grad = random_floats(n, 21), p0 = random_floats(n, 22), m0 = random_floats(n, 23);
  Floats v0 = random_floats(n, 24), vmax0 = random_floats(n, 25);
  for (int64_t i = 0; i < n; ++i) {
    v0[i] = v0[i] * v0[i] * 0.01f;  // a second moment is >= 0
    vmax0[i] = vmax0[i] * vmax0[i] * 0.01f;
  }
  const float clip = 0.61f;
  for (int form = 0; form < 16; ++form) {
    Floats p[3] = {p0, p0, p0}, m[3] = {m0, m0, m0}, v[3] = {v0, v0, v0},
           vmax[3] = {vmax0, vmax0, vmax0};
    for (int path = 0; path < 3; ++path) {
      mgpu::ops::AdamStep body{p[path].data(), grad.data(), m[path].data(), v[path].data(),
                               form & 1 ? &clip : nullptr, 8.0f, 0.1f, 0.999f, 0.001f, 1e-8f,
                               form & 4 ? 0.05f : 0.0f, form & 2 ? 0.99f : 1.0f, 0.013f, 0.03f,
                               form & 8 ? vmax[path].data() : nullptr};
      if (path == 0) avx2::adam_step(0, n, body);
      if (path == 1) avx512::adam_step(0, n, body);
      if (path == 2)
        for (int64_t i = 0; i < n; ++i) body(i);
    }
    const std::string f = "form " + std::to_string(form);
    for (int path = 1; path < 3; ++path) {
      EXPECT_TRUE(same_bits((f + " param").c_str(), p[0], p[path]));
      EXPECT_TRUE(same_bits((f + " m").c_str(), m[0], m[path]));
      EXPECT_TRUE(same_bits((f + " v").c_str(), v[0], v[path]));
      EXPECT_TRUE(same_bits((f + " vmax").c_str(), vmax[0], vmax[path]));
    }
    EXPECT_NE(p[0][7], p0[7]) << f;
  }
}

// One block's sum of squares: both paths give the sum in the documented order exactly (16 lanes,
// lane l adding x[l], x[l + 16], ... as float squares in double, then a fixed tree), for lengths
// with and without a tail.
TEST(CpuIsa, SumOfSquaresSameBitsInTheDocumentedOrder) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{1000},
                    int64_t{1} << 14}) {
    const Floats x = random_floats(static_cast<size_t>(n), 30 + static_cast<uint64_t>(n));
    double lanes[16] = {};
    for (int64_t i = 0; i < n; ++i) {
      const float sq = x[i] * x[i];
      lanes[i % 16] += static_cast<double>(sq);
    }
    for (int half = 8; half > 0; half /= 2)
      for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    EXPECT_EQ(avx2::sum_squares(n, x.data()), lanes[0]) << "n " << n;
    if (avx512_runs()) {
      EXPECT_EQ(avx512::sum_squares(n, x.data()), lanes[0]) << "n " << n;
    }
  }
}

// The path in use is the one isa_choice() names, and a name this CPU supports.
TEST(CpuIsa, ChoiceIsSupported) {
  const IsaChoice& c = isa_choice();
  EXPECT_TRUE(c.name == "avx2" || c.name == "avx512") << c.name;
  EXPECT_FALSE(c.reason.empty());
  if (c.isa == Isa::AVX512) {
    EXPECT_TRUE(avx512_runs());
  }
#if defined(MGPU_AVX512_EMULATED)
  // ctest runs this binary with MGPU_ISA=avx512, so test_kernels.cpp's calls through cpu::NAME
  // run the emulated AVX-512 path.
  EXPECT_EQ(c.name, "avx512") << c.reason;
#endif
  EXPECT_TRUE(cpu_has_avx2());
}

}  // namespace
