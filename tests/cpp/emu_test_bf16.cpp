// tests/cpp/emu_test_bf16.cpp -- the emulator's bfloat16 (cpp/cuda/emu/bf16.h, cuda_bf16.h's
// slice): known bit patterns, and every conversion against an independent reference that rounds
// through double arithmetic (the nearer of the two bfloat16 neighbours, ties to the even one), on
// the host and inside a kernel (tests/cpp/emu_kernels.cu's bf16_round_trip).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/bf16.cuh"
#include "cuda/runtime.cuh"
#include "emu_test_util.h"
#include "float_bits.h"

namespace mgpu_test {  // tests/cpp/emu_kernels.cu
void bf16_round_trip(const float* x, unsigned short* bits, float* back, float* pairs, int n,
                     cudaStream_t stream);
}  // namespace mgpu_test

namespace {

using mgpu_test::DeviceVector;
using mgpu_test::from_bits;
using mgpu_test::to_bits;

// The value of bfloat16 bits (sign, 8-bit exponent, 7-bit fraction) in double, with an exponent
// field of 255 read as 2^128 (the "next value" past the largest finite bfloat16): no float needed.
double bf16_value(uint32_t bits) {
  const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
  const int e = static_cast<int>((bits >> 7) & 0xffu);
  const double frac = static_cast<double>(bits & 0x7fu) / 128.0;
  if (e == 0) return sign * std::ldexp(frac, -126);
  return sign * std::ldexp(1.0 + frac, e - 127);
}

// Round to nearest even by distances: of the bfloat16 values below and above |x| (by magnitude),
// the nearer; on a tie the one with an even last bit; past the largest finite one, inf; NaN to
// the canonical 0x7fff.
unsigned short reference_rn(float x) {
  if (std::isnan(x)) return 0x7fff;
  const uint32_t u = to_bits(x);
  const uint32_t lo = u >> 16, hi = lo + 1;  // magnitudes: hi is lo's next bfloat16 away from 0
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<unsigned short>(lo);
  const double v = static_cast<double>(x);
  const double d_lo = std::fabs(v - bf16_value(lo)), d_hi = std::fabs(bf16_value(hi) - v);
  if (d_lo < d_hi) return static_cast<unsigned short>(lo);
  if (d_hi < d_lo) return static_cast<unsigned short>(hi);
  return static_cast<unsigned short>((lo & 1u) ? hi : lo);
}

struct Known {
  uint32_t in;
  unsigned short out;
  const char* what;
};

const Known kKnown[] = {
    {0x3f800000u, 0x3f80, "1.0 is exact"},
    {0x3f808000u, 0x3f80, "a tie rounds to the even 0x3f80"},
    {0x3f818000u, 0x3f82, "a tie rounds to the even 0x3f82"},
    {0x3f808001u, 0x3f81, "just past the tie rounds up"},
    {0x3f807fffu, 0x3f80, "just below the tie rounds down"},
    {0x40490fdbu, 0x4049, "pi"},
    {0x3eaaaaabu, 0x3eab, "1/3 rounds up"},
    {0xbeaaaaabu, 0xbeab, "-1/3 rounds away from zero"},
    {0x80000000u, 0x8000, "-0 keeps its sign"},
    {0x00018000u, 0x0002, "a denormal tie rounds to even (no flush)"},
    {0x00008000u, 0x0000, "a denormal tie rounds to even zero"},
    {0x807fffffu, 0x8080, "the largest denormal rounds up to -FLT_MIN"},
    {0x7f7fffffu, 0x7f80, "FLT_MAX rounds to inf"},
    {0x7f7f7fffu, 0x7f7f, "just below the overflow threshold stays finite"},
    {0x7f800000u, 0x7f80, "inf"},
    {0xff800000u, 0xff80, "-inf"},
    {0x7fc00001u, 0x7fff, "a quiet NaN becomes the canonical NaN"},
    {0xffc00000u, 0x7fff, "a negative NaN becomes the canonical NaN"},
    {0x7f800001u, 0x7fff, "a signalling NaN becomes the canonical NaN"},
};

TEST(EmuBf16, KnownValues) {
  for (const Known& k : kKnown) {
    const float x = from_bits(k.in);
    EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(x)), k.out) << k.what;
    EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16(x)), k.out) << k.what;
    EXPECT_EQ(reference_rn(x), k.out) << "the reference: " << k.what;
  }
  // Truncation drops the low half; NaNs become the canonical NaN there too.
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rz(from_bits(0x3f80ffffu))), 0x3f80);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rz(from_bits(0xff7fffffu))), 0xff7f);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rz(from_bits(0x7fc00001u))), 0x7fff);
}

TEST(EmuBf16, WideningIsExactAndPairsKeepTheirHalves) {
  EXPECT_EQ(to_bits(__bfloat162float(__ushort_as_bfloat16(0x3f81))), 0x3f810000u);
  EXPECT_EQ(to_bits(__bfloat162float(__ushort_as_bfloat16(0x8001))), 0x80010000u);
  EXPECT_TRUE(std::isnan(__bfloat162float(__ushort_as_bfloat16(0x7fff))));
  const __nv_bfloat162 p = __floats2bfloat162_rn(1.0f, -2.0f);
  uint32_t word;
  static_assert(sizeof p == sizeof word);
  std::memcpy(&word, &p, sizeof word);
  EXPECT_EQ(word, 0xc0003f80u) << ".x is the low half, .y the high half";
  EXPECT_EQ(__low2float(p), 1.0f);
  EXPECT_EQ(__high2float(p), -2.0f);
  const __nv_bfloat162 q = __float2bfloat162_rn(from_bits(0x3f818000u));
  EXPECT_EQ(__bfloat16_as_ushort(q.x), 0x3f82);
  EXPECT_EQ(__bfloat16_as_ushort(q.y), 0x3f82);
}

// Random bit patterns (every exponent, NaNs and infinities among them) plus the known ones, in a
// kernel on an emulated GPU and on the host, against the distance-based reference.
TEST(EmuBf16, KernelRoundsEveryPatternAsTheReference) {
  std::vector<float> x;
  for (const Known& k : kKnown) x.push_back(from_bits(k.in));
  std::mt19937 gen(43);
  for (int i = 0; i < 20000; ++i) {
    uint32_t u = static_cast<uint32_t>(gen());
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // a tie
    if (i % 4 == 1) u = (u & 0xffff0000u) | (u & 1u ? 0x7fffu : 0x8001u);  // beside one
    x.push_back(from_bits(u));
  }
  const int n = static_cast<int>(x.size());
  DeviceVector<float> dx(x), back(x.size()), pairs(x.size());
  DeviceVector<unsigned short> bits(x.size());
  mgpu_test::bf16_round_trip(dx.get(), bits.get(), back.get(), pairs.get(), n, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto got_bits = bits.download();
  const auto got_back = back.download();
  const auto got_pairs = pairs.download();
  for (int i = 0; i < n; ++i) {
    const unsigned short want = reference_rn(x[i]);
    ASSERT_EQ(got_bits[i], want) << "x bits 0x" << std::hex << to_bits(x[i]);
    ASSERT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(x[i])), want);
    ASSERT_EQ(to_bits(got_back[i]), static_cast<uint32_t>(want) << 16);
    if (i + 1 < n || i % 2 == 1) {
      ASSERT_EQ(to_bits(got_pairs[i]), static_cast<uint32_t>(want) << 16) << "pair element " << i;
    }
    if (std::isfinite(x[i]) && std::fabs(x[i]) >= 0x1p-126f && std::isfinite(got_back[i])) {
      // bfloat16 keeps 8 significant bits: a relative error of at most 2^-8.
      ASSERT_LE(std::fabs(got_back[i] - x[i]), std::ldexp(std::fabs(x[i]), -8));
    }
  }
}

}  // namespace
