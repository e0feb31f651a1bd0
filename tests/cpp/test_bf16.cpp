// tests/cpp/test_bf16.cpp -- the bfloat16 products (ops/bf16.h) give the same bits on every CPU
// path: cpu::avx2, cpu::avx512 with the float32-FMA emulation, and cpu::avx512 with vdpbf16ps
// where this CPU has AVX512_BF16 (the emulation is the promise, the instruction the judge). Each
// is also held to the rule bf16.h states, computed here one scalar FMA at a time: the rounding
// against a nearest-even search over the two bfloat16 neighbours, the products against the
// pairwise order (odd element first) with denormals flushed. Accuracy against float64 is
// tests/ops/test_bf16.py's.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "float_bits.h"
#include "ops/cpu_isa.h"

namespace {

using namespace mgpu::ops::cpu;
using mgpu::ops::Conv2dShape;
using mgpu::ops::ConvAlgo;
using mgpu::ops::conv_algo_name;
using mgpu_test::from_bits;
using mgpu_test::to_bits;
using Floats = std::vector<float>;

// Values spread over ~2^-20 .. 2^20 with both signs, one in 64 near the denormal range.
Floats random_floats(size_t n, uint64_t seed) {
  Floats v(n);
  for (float& e : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(seed >> 32);
    uint32_t exponent = 127 + (r % 41) - 20;
    if ((r >> 8) % 64 == 0) exponent = (r >> 16) % 3;
    e = from_bits(((r >> 31) << 31) | (exponent << 23) | ((r * 2654435761u) & 0x7fffffu));
  }
  return v;
}

// The spec of the rounding, computed independently of the kernels' bit trick: the two bfloat16
// values around x (truncation and the next one up in magnitude), the nearer in double, a tie to
// the even one (so values from halfway past the largest finite one round to inf); denormals and
// zeros to a signed zero, inf kept, NaN quieted.
uint16_t reference_bf16(float x) {
  const uint32_t b = to_bits(x);
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0.0f) return static_cast<uint16_t>((b >> 16) & 0x8000u);
  if (std::isinf(x)) return static_cast<uint16_t>(b >> 16);
  if (std::isnan(x)) return static_cast<uint16_t>((b >> 16) | 0x40u);
  const uint32_t down = b >> 16, up = down + 1;
  const double dx = std::fabs(static_cast<double>(x));
  const double dd = std::fabs(static_cast<double>(from_bits(down << 16)));
  // Past the largest finite bfloat16 the next value up is 2^128 (IEEE rounds to inf from
  // halfway between the largest finite value and 2^128).
  const bool overflows = (up & 0x7fffu) == 0x7f80u;
  const double du = overflows ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(from_bits(up << 16)));
  if (dx - dd < du - dx) return static_cast<uint16_t>(down);
  if (dx - dd > du - dx) return static_cast<uint16_t>(up);
  return static_cast<uint16_t>((down & 1u) ? up : down);
}

float flush(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
float bf16_value(float x) { return from_bits(static_cast<uint32_t>(reference_bf16(x)) << 16); }

// op(A) (m, k) @ op(B) (k, n) by the rule: per k pair in order, the odd element's FMA, then the
// even one's, each result flushed; a missing odd element is a zero.
Floats reference_product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const Floats& a,
                         const Floats& b) {
  auto A = [&](int64_t i, int64_t kk) { return kk < k ? bf16_value(ta ? a[kk * m + i] : a[i * k + kk]) : 0.0f; };
  auto B = [&](int64_t kk, int64_t j) { return kk < k ? bf16_value(tb ? b[j * k + kk] : b[kk * n + j]) : 0.0f; };
  Floats c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; kk += 2) {
        acc = flush(std::fma(A(i, kk + 1), B(kk + 1, j), acc));
        acc = flush(std::fma(A(i, kk), B(kk, j), acc));
      }
      c[static_cast<size_t>(i * n + j)] = acc;
    }
  }
  return c;
}

::testing::AssertionResult same_bits(const std::string& what, const Floats& want,
                                     const Floats& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < want.size(); ++i) {
    if (to_bits(want[i]) != to_bits(got[i])) {
      return ::testing::AssertionFailure() << what << ": first difference at " << i << ": "
                                           << want[i] << " vs " << got[i];
    }
  }
  return ::testing::AssertionSuccess();
}

bool avx512_runs() { return cpu_has_avx512(); }

__attribute__((target("avx512f,avx512bf16"))) uint16_t hardware_bf16(float x) {
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_set1_ps(x));
  uint16_t out[16];
  std::memcpy(out, &h, sizeof out);
  return out[0];
}

// Every class of float (a stride through all 2^32 patterns, plus ties and the edges): the kernels
// give the spec's bits on both paths, and vcvtneps2bf16's where the CPU has it.
TEST(Bf16CpuIsa, RoundingIsNearestEvenOnEveryPath) {
  Floats xs;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521) xs.push_back(from_bits(static_cast<uint32_t>(u)));
  for (uint32_t u : {0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x7f7fffffu, 0xff7f8000u, 0x00000001u,
                     0x80800000u, 0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x007fffffu}) {
    xs.push_back(from_bits(u));
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<uint16_t> y2(xs.size()), y5(xs.size());
  avx2::bf16_round(n, xs.data(), y2.data());
  if (avx512_runs()) {
    avx512::bf16_round(n, xs.data(), y5.data());
  } else {
    y5 = y2;
  }
  const bool hw = cpu_has_avx512_bf16();
  for (size_t i = 0; i < xs.size(); ++i) {
    const uint16_t want = reference_bf16(xs[i]);
    ASSERT_EQ(y2[i], want) << "avx2, x bits " << std::hex << to_bits(xs[i]);
    ASSERT_EQ(y5[i], want) << "avx512, x bits " << std::hex << to_bits(xs[i]);
    if (hw) {
      ASSERT_EQ(hardware_bf16(xs[i]), want) << "vcvtneps2bf16, x bits " << std::hex
                                            << to_bits(xs[i]);
    }
  }
}

struct MmCase {
  bool ta, tb;
  int64_t m, n, k;
};

// Products with tails in every direction and odd k, each transposition: the same bits on every
// path, equal to the rule's.
TEST(Bf16CpuIsa, ProductsGiveTheRulesBitsOnEveryPath) {
  for (const MmCase& t : {MmCase{false, false, 13, 45, 37}, MmCase{true, false, 8, 32, 64},
                          MmCase{false, true, 17, 33, 1}, MmCase{true, true, 9, 70, 130},
                          MmCase{false, false, 3, 5, 0}}) {
    const Floats a = random_floats(static_cast<size_t>(t.m * t.k), 11 + t.m);
    const Floats b = random_floats(static_cast<size_t>(t.k * t.n), 23 + t.n);
    const Floats want = reference_product(t.ta, t.tb, t.m, t.n, t.k, a, b);
    const int64_t lda = t.ta ? t.m : t.k, ldb = t.tb ? t.k : t.n;
    const std::string name = "m" + std::to_string(t.m) + " n" + std::to_string(t.n) + " k" +
                             std::to_string(t.k) + (t.ta ? " A^T" : "") + (t.tb ? " B^T" : "");
    Floats c(want.size(), -1.0f);
    avx2::bf16_mm(t.ta, t.tb, t.m, t.n, t.k, a.data(), lda, b.data(), ldb, c.data(), false);
    EXPECT_TRUE(same_bits("avx2 " + name, want, c));
    if (!avx512_runs()) continue;
    std::fill(c.begin(), c.end(), -1.0f);
    avx512::bf16_mm(t.ta, t.tb, t.m, t.n, t.k, a.data(), lda, b.data(), ldb, c.data(), false);
    EXPECT_TRUE(same_bits("avx512 " + name, want, c));
    if (!cpu_has_avx512_bf16()) continue;
    std::fill(c.begin(), c.end(), -1.0f);
    avx512::bf16_mm(t.ta, t.tb, t.m, t.n, t.k, a.data(), lda, b.data(), ldb, c.data(), true);
    EXPECT_TRUE(same_bits("avx512_bf16 " + name, want, c));
  }
}

// A product that accumulates starts from c's old value: the rule with acc = c.
TEST(Bf16CpuIsa, AccumulatingProductStartsFromC) {
  const int64_t m = 10, n = 40, k = 7;
  const Floats a = random_floats(m * k, 5), b = random_floats(k * n, 6), c0 = random_floats(m * n, 7);
  std::vector<uint32_t> pa(bf16_packed_a_words(m, k)), pb(bf16_packed_b_words(k, n));
  avx2::bf16_pack_a(false, m, k, a.data(), k, pa.data());
  avx2::bf16_pack_b(false, k, n, b.data(), n, pb.data());
  Floats want(c0.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = c0[i * n + j];
      for (int64_t kk = 0; kk < k; kk += 2) {
        const float a1 = kk + 1 < k ? bf16_value(a[i * k + kk + 1]) : 0.0f;
        const float b1 = kk + 1 < k ? bf16_value(b[(kk + 1) * n + j]) : 0.0f;
        acc = flush(std::fma(a1, b1, acc));
        acc = flush(std::fma(bf16_value(a[i * k + kk]), bf16_value(b[kk * n + j]), acc));
      }
      want[i * n + j] = acc;
    }
  }
  Floats c = c0;
  avx2::bf16_product({m, n, k, pa.data(), pb.data(), c.data(), n, true, false});
  EXPECT_TRUE(same_bits("avx2", want, c));
  if (cpu_has_avx512_bf16()) {
    c = c0;
    avx512::bf16_product({m, n, k, pa.data(), pb.data(), c.data(), n, true, true});
    EXPECT_TRUE(same_bits("avx512_bf16", want, c));
  }
}

// Products whose results fall below float32's normal range (operands near 2^-66, products near
// 2^-132) are flushed to zero, and a denormal starting value of c is read as zero, as
// vdpbf16ps does: the emulation must run with MXCSR.FTZ|DAZ.
TEST(Bf16CpuIsa, DenormalResultsAreFlushedOnEveryPath) {
  const int64_t m = 9, n = 33, k = 6;
  Floats a = random_floats(m * k, 8), b = random_floats(k * n, 9);
  for (float& v : a) v = std::ldexp(std::fabs(v) / (1.0f + std::fabs(v)), -66);
  for (float& v : b) v = std::ldexp(std::fabs(v) / (1.0f + std::fabs(v)), -66);
  std::vector<uint32_t> pa(bf16_packed_a_words(m, k)), pb(bf16_packed_b_words(k, n));
  avx2::bf16_pack_a(false, m, k, a.data(), k, pa.data());
  avx2::bf16_pack_b(false, k, n, b.data(), n, pb.data());
  const Floats c0(static_cast<size_t>(m * n), std::ldexp(1.0f, -130));  // denormal
  Floats want(c0.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = flush(c0[i * n + j]);
      for (int64_t kk = 0; kk < k; kk += 2) {
        acc = flush(std::fma(bf16_value(a[i * k + kk + 1]), bf16_value(b[(kk + 1) * n + j]), acc));
        acc = flush(std::fma(bf16_value(a[i * k + kk]), bf16_value(b[kk * n + j]), acc));
      }
      want[i * n + j] = acc;
    }
  }
  int64_t flushed = 0;
  for (float v : want) flushed += v == 0.0f;
  ASSERT_GT(flushed, 0) << "the data must produce results below the normal range";
  std::vector<std::pair<int, bool>> paths = {{2, false}};
  if (avx512_runs()) paths.push_back({5, false});
  if (cpu_has_avx512_bf16()) paths.push_back({5, true});
  for (auto [isa, hw] : paths) {
    Floats c = c0;
    const Bf16Product q{m, n, k, pa.data(), pb.data(), c.data(), n, true, hw};
    isa == 2 ? avx2::bf16_product(q) : avx512::bf16_product(q);
    EXPECT_TRUE(same_bits(std::string(isa == 2 ? "avx2" : hw ? "avx512_bf16" : "avx512"), want, c));
  }
}

// conv2d's three passes in bf16: the same bits on every path (padding, stride 2, odd P*Q, chunks
// of several images, a tail chunk; the data gradient as a forward pass for stride 1 with pad 0
// to R-1 and through col2im otherwise; 4x4 outputs, whose rows the unfolding's vector copies
// run past), by im2col (direct), by Winograd F(2x2, 3x3) where it applies (odd images whose
// edge tiles overhang, an odd channel count, pad 0 to 2, several chunks of images), and by auto
// (float32's kernels on rounded operands, Winograd F(4x4, 3x3) among them, and the products).
TEST(Bf16CpuIsa, ConvPassesGiveTheSameBitsOnEveryPath) {
  if (!avx512_runs()) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (ConvAlgo algo : {ConvAlgo::Direct, ConvAlgo::Winograd, ConvAlgo::Auto})
  for (const Conv2dShape& s : {Conv2dShape{5, 3, 9, 7, 10, 3, 3, 1, 1},
                               Conv2dShape{3, 6, 8, 8, 5, 3, 3, 2, 1},
                               Conv2dShape{70, 4, 5, 5, 3, 1, 1, 1, 0},
                               Conv2dShape{40, 2, 6, 6, 5, 5, 5, 1, 2},
                               Conv2dShape{3, 4, 9, 9, 5, 3, 3, 1, 0},
                               Conv2dShape{4, 3, 7, 7, 6, 1, 1, 1, 1},
                               Conv2dShape{33, 20, 4, 4, 40, 3, 3, 1, 1},
                               Conv2dShape{3, 17, 9, 11, 20, 3, 3, 1, 2},
                               Conv2dShape{300, 130, 5, 5, 9, 3, 3, 1, 0}}) {
    const int64_t P = s.P(), Q = s.Q();
    const Floats x = random_floats(s.N * s.C * s.H * s.W, 1), w = random_floats(s.K * s.C * s.R * s.S, 2);
    const Floats b = random_floats(s.K, 3), dy = random_floats(s.N * s.K * P * Q, 4);
    std::vector<Floats> y, dx, dw, db;
    std::vector<std::pair<int, bool>> paths = {{2, false}, {5, false}};
    if (cpu_has_avx512_bf16()) paths.push_back({5, true});
    for (auto [isa, hw] : paths) {
      Floats yi(s.N * s.K * P * Q), dxi(x.size()), dwi(w.size()), dbi(s.K);
      if (isa == 2) {
        avx2::bf16_conv2d_forward(s, x.data(), w.data(), b.data(), yi.data(), hw, algo);
        avx2::bf16_conv2d_backward(s, x.data(), w.data(), dy.data(), dxi.data(), dwi.data(), dbi.data(), hw, algo);
      } else {
        avx512::bf16_conv2d_forward(s, x.data(), w.data(), b.data(), yi.data(), hw, algo);
        avx512::bf16_conv2d_backward(s, x.data(), w.data(), dy.data(), dxi.data(), dwi.data(), dbi.data(), hw, algo);
      }
      y.push_back(yi), dx.push_back(dxi), dw.push_back(dwi), db.push_back(dbi);
    }
    for (size_t p = 1; p < y.size(); ++p) {
      const std::string path = std::string(conv_algo_name(algo)) + " " + (p == 1 ? "avx512" : "avx512_bf16");
      EXPECT_TRUE(same_bits(path + " y", y[0], y[p]));
      EXPECT_TRUE(same_bits(path + " dx", dx[0], dx[p]));
      EXPECT_TRUE(same_bits(path + " dw", dw[0], dw[p]));
      EXPECT_TRUE(same_bits(path + " db", db[0], db[p]));
    }
  }
}

// auto takes vdpbf16ps exactly where the CPU has it (MGPU_ISA unset or auto in this binary).
TEST(Bf16CpuIsa, AutoUsesTheInstructionWhereTheCpuHasIt) {
  const char* env = std::getenv("MGPU_ISA");
  if (env && std::string(env) != "auto") GTEST_SKIP() << "MGPU_ISA=" << env;
  EXPECT_EQ(bf16_hardware_dot(), cpu_has_avx512_bf16());
}

}  // namespace
