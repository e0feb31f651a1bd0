// tests/cpp/avx512_emulated.h -- the AVX-512 path of the CPU kernels, compiled for AVX2 hardware
// so that its logic runs (and is tested) on CPUs without AVX-512. Test builds only: CMakeLists.txt
// compiles the MGPU_CPU_ISA_SOURCES a third time, into namespace cpu::avx512, with
// -march=x86-64-v3 and `-include` of this header, and links those objects into
// mgpu_avx512_emulated_tests in place of the real AVX-512 ones.
//
// The kernels choose their path by the compiler's feature macros (`#if defined(__AVX512F__)`:
// 16-float vectors, the AVX-512 register tiles, 16-lane chunks). This header includes the
// intrinsics first, while those macros are still undefined (so <immintrin.h> declares its
// AVX-512 functions for AVX-512 targets only), then defines the macros, so every kernel source
// after it compiles its AVX-512 branches, and renames the few AVX-512 intrinsics the kernels call
// to the functions below, which do the same per lane with 8-lane AVX2 instructions and scalar
// code. GCC lowers the kernels' 16-float vector-extension arithmetic to pairs of 8-float
// instructions; an a * b + c it contracts is one FMA per lane either way, so every lane computes
// what the AVX-512 build computes and the emulated path must give the AVX-512 path's bits, which
// both paths promise equal to the AVX2 path's (cpu_isa.h). What this does not check: that the
// real AVX-512 build's instruction selection keeps that promise (test_cpu_isa.cpp checks it on a
// CPU with AVX-512), nor any AVX-512 speed.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#error "avx512_emulated.h is for a build without AVX-512 (-march=x86-64-v3)"
#endif
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#define MGPU_AVX512_EMULATED 1

namespace mgpu_avx512_emulated {

// Halves of a 16-float vector as AVX2 registers, and back.
inline __m256 lo(__m512 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline __m256 hi(__m512 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m512 join(__m256 a, __m256 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

inline __m512 setzero_ps() { return __m512{}; }
inline __m512 set1_ps(float x) { return join(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
inline __m512 loadu_ps(const void* p) {
  __m512 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storeu_ps(void* p, __m512 v) { std::memcpy(p, &v, sizeof v); }
inline void store_ps(void* p, __m512 v) { std::memcpy(p, &v, sizeof v); }
inline __m512i load_si512(const void* p) {
  __m512i v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// One rounding per lane, as vfmadd*ps does.
inline __m512 fmadd_ps(__m512 a, __m512 b, __m512 c) {
  return join(_mm256_fmadd_ps(lo(a), lo(b), lo(c)), _mm256_fmadd_ps(hi(a), hi(b), hi(c)));
}
inline __m512 add_ps(__m512 a, __m512 b) {
  return join(_mm256_add_ps(lo(a), lo(b)), _mm256_add_ps(hi(a), hi(b)));
}
// Bit i set where the 32-bit lanes i of a and b share a set bit.
inline __mmask16 test_epi32_mask(__m512i a, __m512i b) {
  int32_t x[16], y[16];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  unsigned m = 0;
  for (int i = 0; i < 16; ++i) m |= unsigned{(x[i] & y[i]) != 0} << i;
  return static_cast<__mmask16>(m);
}
// Lane i: the float at base + index[i] * scale bytes where mask bit i is set, else src's lane i.
// Lanes left out are not read, as with the real gather (they may point past the data).
inline __m512 mask_i32gather_ps(__m512 src, __mmask16 k, __m512i index, const void* base,
                                int scale) {
  float out[16];
  int32_t idx[16];
  std::memcpy(out, &src, sizeof out);
  std::memcpy(idx, &index, sizeof idx);
  for (int i = 0; i < 16; ++i) {
    if (k >> i & 1) {
      std::memcpy(&out[i], static_cast<const char*>(base) + int64_t{idx[i]} * scale,
                  sizeof(float));
    }
  }
  return loadu_ps(out);
}

}  // namespace mgpu_avx512_emulated

#undef _mm512_setzero_ps
#define _mm512_setzero_ps mgpu_avx512_emulated::setzero_ps
#undef _mm512_set1_ps
#define _mm512_set1_ps mgpu_avx512_emulated::set1_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps mgpu_avx512_emulated::loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps mgpu_avx512_emulated::storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps mgpu_avx512_emulated::store_ps
#undef _mm512_load_si512
#define _mm512_load_si512 mgpu_avx512_emulated::load_si512
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps mgpu_avx512_emulated::fmadd_ps
#undef _mm512_add_ps
#define _mm512_add_ps mgpu_avx512_emulated::add_ps
#undef _mm512_test_epi32_mask
#define _mm512_test_epi32_mask mgpu_avx512_emulated::test_epi32_mask
#undef _mm512_mask_i32gather_ps
#define _mm512_mask_i32gather_ps mgpu_avx512_emulated::mask_i32gather_ps
