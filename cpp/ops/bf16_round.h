// cpp/ops/bf16_round.h -- float32 -> bfloat16 rounding (bf16.h's rule) for the per-path kernels,
// one value or 16 lanes at a time; included by files compiled per path (cpu_isa.h), so it lives
// in namespace cpu::MGPU_CPU_ISA::bf16. The rule: round to nearest, ties to even (add 0x7fff
// plus the kept part's lowest bit, keep the top half); zeros and float32 denormals become a zero
// of their sign; +-inf stays; a NaN stays a NaN with its sign and top mantissa bits, quieted.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mgpu::ops::cpu::MGPU_CPU_ISA::bf16 {

typedef uint32_t Vu __attribute__((vector_size(64), aligned(4), may_alias));

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The bfloat16 bits of x (in the low 16 bits).
inline uint32_t to_bf16(float x) {
  const uint32_t b = bits_of(x), e = b & 0x7f800000u;
  if (e == 0) return (b >> 16) & 0x8000u;
  if (e == 0x7f800000u) return (b >> 16) | ((b & 0x7fffffu) ? 0x40u : 0u);
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// The same for a vector of lanes of float bits (branch-free: every case computed, then selected
// by masks), on naturally aligned local vectors: V is a plain vector type (a template argument
// drops a typedef's aligned(4), so V's loads and stores here may assume V's alignment).
template <class V>
inline void to_bf16_lanes(const V& b, V& out) {
  const V e = b & 0x7f800000u;
  const V zero = (V)(e == 0u), special = (V)(e == 0x7f800000u);
  const V nan = (V)((b & 0x7fffffu) != 0u) & special;
  const V rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const V top = b >> 16;
  out = (rounded & ~(zero | special)) | ((top & 0x8000u) & zero) | (top & special) | (nan & 0x40u);
}

// 16 lanes wherever they lie (Vu: unaligned). Through references: a 64-byte vector argument or
// result would change the ABI on the AVX2 path.
typedef uint32_t V16 __attribute__((vector_size(64)));
inline void to_bf16(const Vu& b, Vu& out) {
  V16 v, r;
  std::memcpy(&v, &b, sizeof v);
  to_bf16_lanes(v, r);
  std::memcpy(&out, &r, sizeof r);
}

// The path's native vector: 16 lanes on AVX-512, 8 on AVX2 (where 64-byte generic vectors are
// split into halves and, in loops, kept on the stack: the rounding then ran several times slower).
#if defined(__AVX512F__)
typedef uint32_t Vn __attribute__((vector_size(64)));
#else
typedef uint32_t Vn __attribute__((vector_size(32)));
#endif

// p[i] = p[i] rounded to bfloat16 and widened back to float32 (its low 16 bits zero), in place,
// for i < 16 * vectors.
inline void round_vectors(float* p, int64_t vectors) {
  constexpr int64_t kLanes = sizeof(Vn) / sizeof(uint32_t);
  for (int64_t i = 0; i < 16 * vectors; i += kLanes) {
    Vn v, r;
    std::memcpy(&v, p + i, sizeof v);
    to_bf16_lanes(v, r);
    r <<= 16;
    std::memcpy(p + i, &r, sizeof r);
  }
}

// The same for any n.
inline void round_in_place(float* p, int64_t n) {
  round_vectors(p, n / 16);
  for (int64_t i = n / 16 * 16; i < n; ++i) p[i] = float_of(to_bf16(p[i]) << 16);
}

// MXCSR.FTZ|DAZ while the float32-FMA emulation of the bfloat16 products runs (bf16_cpu.cpp,
// conv2d_cpu/lanes_bf16.cpp), restored after: the emulation then flushes denormals as vdpbf16ps
// does (vdpbf16ps ignores MXCSR).
struct FlushDenormals {
  unsigned saved;
  bool on;
  explicit FlushDenormals(bool enable) : saved(_mm_getcsr()), on(enable) {
    if (on) _mm_setcsr(saved | 0x8040u);
  }
  ~FlushDenormals() {
    if (on) _mm_setcsr(saved);
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::bf16
