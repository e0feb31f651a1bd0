// cpp/ops/fma_peak_cpu.cpp -- the FMA-peak loop, compiled once per instruction-set path (listed in
// MGPU_CPU_ISA_SOURCES): kFmaAccumulators independent accumulators, enough to keep every FMA
// pipe busy through the FMA latency (Zen 4: 2 pipes x 4 cycles of 256-bit FMAs need 8 in flight;
// an AVX-512 FMA takes both pipes, so 4), each a whole vector register of the path's width.
#include <immintrin.h>

#include "ops/fma_peak.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec x, Vec y, Vec z) { return _mm512_fmadd_ps(x, y, z); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int kWidth = 8;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec x, Vec y, Vec z) { return _mm256_fmadd_ps(x, y, z); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

int fma_lanes() { return kFmaAccumulators * kWidth; }

double fma_loop(int64_t iters, float a, float b) {
  const Vec va = splat(a), vb = splat(b);
  Vec acc[kFmaAccumulators];
  for (Vec& v : acc) v = splat(0.0f);
  for (int64_t i = 0; i < iters; ++i) {
    // The accumulators do not depend on each other: the FMAs of one round issue back to back.
    for (Vec& v : acc) v = vfma(v, va, vb);
  }
  // The lanes' sum keeps every FMA's result alive (the compiler cannot drop the loop) and tells
  // the caller how many ran.
  double sum = 0.0;
  float lanes[kWidth];
  for (const Vec& v : acc) {
    store(lanes, v);
    for (float x : lanes) sum += x;
  }
  return sum;
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
