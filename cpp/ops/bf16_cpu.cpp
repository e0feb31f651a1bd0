// cpp/ops/bf16_cpu.cpp -- the bfloat16 products (ops/bf16.h) for one CPU path, compiled per path
// into namespace cpu::MGPU_CPU_ISA: rounding, packing, the register tiles, and linear's and
// conv2d's passes on them. Every path computes each output with the same FMAs in the same order
// (bf16.h), so the paths give the same bits: vdpbf16ps on the AVX-512 path where the CPU has
// AVX512_BF16, float32 FMAs on bfloat16-rounded values (under MXCSR.FTZ|DAZ) everywhere else.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/parallel.h"
#include "ops/bf16.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

typedef float Vf __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t Vu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t Vi __attribute__((vector_size(64)));

constexpr int64_t kMr = kBf16Mr, kNr = kBf16Nr;

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

// float -> bfloat16 bits (bf16.h): zeros and denormals to a signed zero, inf kept, NaN kept and
// quieted, the rest rounded to nearest even by adding 0x7fff plus the kept part's lowest bit.
inline uint32_t to_bf16(float x) {
  const uint32_t b = bits_of(x), e = b & 0x7f800000u;
  if (e == 0) return (b >> 16) & 0x8000u;
  if (e == 0x7f800000u) return (b >> 16) | ((b & 0x7fffffu) ? 0x40u : 0u);
  return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// The same for 16 lanes at once (branch-free: every case computed, then selected by masks).
// Through references: a 64-byte vector argument or result would change the ABI on the AVX2 path.
inline void to_bf16(const Vu& b, Vu& out) {
  const Vu e = b & 0x7f800000u;
  const Vu zero = (Vu)(e == 0u), special = (Vu)(e == 0x7f800000u);
  const Vu nan = (Vu)((b & 0x7fffffu) != 0u) & special;
  const Vu rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const Vu top = b >> 16;
  out = (rounded & ~(zero | special)) | ((top & 0x8000u) & zero) | (top & special) | (nan & 0x40u);
}


// Packs kW words per k pair: word j of pair p holds (bf16(e(2p + 1, j0 + j)) << 16) |
// bf16(e(2p, j0 + j)), zero past k rows or past `width` columns. `rows` form: element (kk, j) at
// src[kk * ld + j] (pairs are two rows, columns contiguous); `cols` form: at src[j * ld + kk]
// (a pair is two adjacent floats).
template <int64_t kW>
void pack_rows(const float* src, int64_t ld, int64_t k, int64_t j0, int64_t width,
               uint32_t* out) {
  const int64_t pairs = bf16_pairs(k), w = std::min(kW, width - j0);
  for (int64_t p = 0; p < pairs; ++p, out += kW) {
    const float* r0 = src + 2 * p * ld + j0;
    const float* r1 = 2 * p + 1 < k ? r0 + ld : nullptr;
    int64_t j = 0;
    if (r1 != nullptr) {
      for (; j + 16 <= w; j += 16) {
        Vu lo, hi;
        to_bf16(*reinterpret_cast<const Vu*>(r0 + j), lo);
        to_bf16(*reinterpret_cast<const Vu*>(r1 + j), hi);
        *reinterpret_cast<Vu*>(out + j) = (hi << 16) | lo;
      }
    }
    for (; j < w; ++j) out[j] = (r1 ? to_bf16(r1[j]) << 16 : 0u) | to_bf16(r0[j]);
    for (; j < kW; ++j) out[j] = 0;
  }
}

template <int64_t kW>
void pack_cols(const float* src, int64_t ld, int64_t k, int64_t j0, int64_t width,
               uint32_t* out) {
  const int64_t pairs = bf16_pairs(k), w = std::min(kW, width - j0);
  for (int64_t j = 0; j < kW; ++j) {
    uint32_t* o = out + j;
    if (j >= w) {
      for (int64_t p = 0; p < pairs; ++p) o[p * kW] = 0;
      continue;
    }
    const float* s = src + (j0 + j) * ld;
    for (int64_t p = 0; p < k / 2; ++p) {
      o[p * kW] = (to_bf16(s[2 * p + 1]) << 16) | to_bf16(s[2 * p]);
    }
    if (k % 2) o[(pairs - 1) * kW] = to_bf16(s[k - 1]);
  }
}

// MXCSR.FTZ|DAZ for the float32-FMA emulation while it runs (vdpbf16ps ignores MXCSR), restored
// after, so the emulation flushes denormals as vdpbf16ps does.
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

// The register tile t (kMr x kNr floats, rows kNr apart) += the product of one packed panel pair
// over `pairs` k pairs, as float32 FMAs: per pair, the odd element's product, then the even one's.
// A sub-tile of kRows x 16 * kVecs at (r0, c0) at a time: 8 x 32 on AVX-512 (16 accumulators),
// 4 x 16 on AVX2 (8 ymm accumulators); the order of each output's adds is the same either way.
template <int kRows, int kVecs>
inline void tile_fma_part(int64_t pairs, const uint32_t* pa, const uint32_t* pb, float* t,
                          int64_t r0, int64_t c0) {
  Vf acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = *reinterpret_cast<const Vf*>(t + (r0 + r) * kNr + c0 + 16 * v);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    Vf bh[kVecs], bl[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      const Vu w = *reinterpret_cast<const Vu*>(pb + p * kNr + c0 + 16 * v);
      bh[v] = (Vf)(w & 0xffff0000u);
      bl[v] = (Vf)(w << 16);
    }
    for (int r = 0; r < kRows; ++r) {
      const uint32_t w = pa[p * kMr + r0 + r];
      const float ah = float_of(w & 0xffff0000u), al = float_of(w << 16);
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v] = ah * bh[v] + acc[r][v];
        acc[r][v] = al * bl[v] + acc[r][v];
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) *reinterpret_cast<Vf*>(t + (r0 + r) * kNr + c0 + 16 * v) = acc[r][v];
  }
}

__attribute__((noinline)) void tile_fma(int64_t pairs, const uint32_t* pa, const uint32_t* pb,
                                        float* t) {
#if defined(__AVX512F__)
  tile_fma_part<8, 2>(pairs, pa, pb, t, 0, 0);
#else
  for (int64_t r0 = 0; r0 < kMr; r0 += 4) {
    for (int64_t c0 = 0; c0 < kNr; c0 += 16) tile_fma_part<4, 1>(pairs, pa, pb, t, r0, c0);
  }
#endif
}

#if defined(__AVX512F__)
// The same tile with vdpbf16ps: one instruction per 16 outputs and k pair. Compiled for
// AVX512_BF16 on top of the AVX-512 path's -march, called only where the CPU has it
// (bf16_hardware_dot); the AVX2 path runs the emulation whatever hardware_dot says.
__attribute__((noinline, target("avx512f,avx512bf16"))) void tile_dpbf16(
    int64_t pairs, const uint32_t* pa, const uint32_t* pb, float* t) {
  __m512 acc[kMr][2];
  for (int r = 0; r < kMr; ++r) {
    acc[r][0] = _mm512_loadu_ps(t + r * kNr);
    acc[r][1] = _mm512_loadu_ps(t + r * kNr + 16);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + p * kNr);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + p * kNr + 16);
    for (int r = 0; r < kMr; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pa[p * kMr + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  for (int r = 0; r < kMr; ++r) {
    _mm512_storeu_ps(t + r * kNr, acc[r][0]);
    _mm512_storeu_ps(t + r * kNr + 16, acc[r][1]);
  }
}
#endif

// Output tile (ip, jp) of a product: c's block copied into the register tile (or zeros), the
// panels multiplied in, the block copied back.
void product_tile(const Bf16Product& q, int64_t ip, int64_t jp) {
  alignas(64) float t[kMr * kNr];
  const int64_t pairs = bf16_pairs(q.k), i0 = ip * kMr, j0 = jp * kNr;
  const int64_t rows = std::min(kMr, q.m - i0), cols = std::min(kNr, q.n - j0);
  std::fill(t, t + kMr * kNr, 0.0f);
  if (q.accumulate) {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(q.c + (i0 + r) * q.ldc + j0, cols, t + r * kNr);
  }
  const uint32_t* pa = q.pa + ip * kMr * pairs;
  const uint32_t* pb = q.pb + jp * kNr * pairs;
#if defined(__AVX512F__)
  if (q.hardware_dot) {
    tile_dpbf16(pairs, pa, pb, t);
  } else {
    tile_fma(pairs, pa, pb, t);
  }
#else
  tile_fma(pairs, pa, pb, t);
#endif
  for (int64_t r = 0; r < rows; ++r) std::copy_n(t + r * kNr, cols, q.c + (i0 + r) * q.ldc + j0);
}

inline int64_t panels(int64_t n, int64_t w) { return (n + w - 1) / w; }

// Every tile of a product, spread over the device's cores (tiles are independent).
void product_parallel(const Bf16Product& q) {
  if (q.m == 0 || q.n == 0) return;
  const int64_t mp = panels(q.m, kMr), np = panels(q.n, kNr);
  parallel_for(np, [&](int64_t jp) {
    FlushDenormals ftz(!q.hardware_dot);
    for (int64_t ip = 0; ip < mp; ++ip) product_tile(q, ip, jp);
  });
}

// Packs `width` rows (A, kW = kMr) or columns (B, kW = kNr) of a (width, k) or (k, width)
// operand in panels of kW, one panel per task; `pairs_along_rows` picks pack_rows' layout.
template <int64_t kW>
void pack_parallel(bool pairs_along_rows, int64_t width, int64_t k, const float* src, int64_t ld,
                   uint32_t* out) {
  const int64_t stride = kW * bf16_pairs(k);
  parallel_for(panels(width, kW), [&](int64_t p) {
    if (pairs_along_rows) {
      pack_rows<kW>(src, ld, k, p * kW, width, out + p * stride);
    } else {
      pack_cols<kW>(src, ld, k, p * kW, width, out + p * stride);
    }
  });
}

// op(A) (m, k): A^T has its k pairs in two rows of a; op(B) (k, n): B untransposed does.
void pack_a_parallel(bool trans, int64_t m, int64_t k, const float* a, int64_t lda,
                     uint32_t* out) {
  pack_parallel<kMr>(trans, m, k, a, lda, out);
}
void pack_b_parallel(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb,
                     uint32_t* out) {
  pack_parallel<kNr>(!trans, n, k, b, ldb, out);
}

// The calling thread's buffers, grown to the largest shape seen and reused.
thread_local std::vector<uint32_t> tl_pack_a, tl_pack_b;
thread_local std::vector<uint32_t> tl_pack_dy_a, tl_pack_dy_b, tl_pack_rows;
thread_local std::vector<float> tl_col, tl_rows, tl_dy, tl_out;

template <typename T>
T* grow(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// Images per chunk of a conv pass: enough for ~2048 product columns (B * P * Q), between 1 and
// 64; a function of the shape alone, so the order of dw's sums never depends on the threads.
int64_t chunk_images(const Conv2dShape& s) {
  const int64_t pq = s.P() * s.Q();
  return std::clamp<int64_t>((2048 + pq - 1) / pq, 1, 64);
}

// dy's chunk of images n0 .. n0 + B as one (K, B * P * Q) matrix, image i in columns i * PQ...
void gather_dy(const Conv2dShape& s, const float* dy, int64_t n0, int64_t B, float* out) {
  const int64_t PQ = s.P() * s.Q(), ld = B * PQ;
  parallel_for(s.K, [&](int64_t k) {
    for (int64_t i = 0; i < B; ++i) {
      std::copy_n(dy + ((n0 + i) * s.K + k) * PQ, PQ, out + k * ld + i * PQ);
    }
  });
}

}  // namespace

void bf16_round(int64_t n, const float* x, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<uint16_t>(to_bf16(x[i]));
}

void bf16_pack_a(bool trans, int64_t m, int64_t k, const float* a, int64_t lda, uint32_t* out) {
  pack_a_parallel(trans, m, k, a, lda, out);
}

void bf16_pack_b(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, uint32_t* out) {
  pack_b_parallel(trans, k, n, b, ldb, out);
}

void bf16_product(const Bf16Product& q) {
  FlushDenormals ftz(!q.hardware_dot);
  for (int64_t jp = 0; jp < panels(q.n, kNr); ++jp) {
    for (int64_t ip = 0; ip < panels(q.m, kMr); ++ip) product_tile(q, ip, jp);
  }
}

void bf16_mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, bool hardware_dot) {
  if (m == 0 || n == 0) return;
  uint32_t* pa = grow(tl_pack_a, bf16_packed_a_words(m, k));
  uint32_t* pb = grow(tl_pack_b, bf16_packed_b_words(k, n));
  pack_a_parallel(trans_a, m, k, a, lda, pa);
  pack_b_parallel(trans_b, k, n, b, ldb, pb);
  product_parallel({m, n, k, pa, pb, c, n, false, hardware_dot});
}

void bf16_conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, bool hardware_dot) {
  const conv::Unfold u(s);
  const int64_t CRS = s.C * s.R * s.S, PQ = u.P * u.Q, CHW = s.C * s.H * s.W;
  const int64_t chunk = chunk_images(s);
  uint32_t* pw = grow(tl_pack_a, bf16_packed_a_words(s.K, CRS));
  pack_a_parallel(false, s.K, CRS, w, CRS, pw);
  for (int64_t n0 = 0; n0 < s.N; n0 += chunk) {
    const int64_t B = std::min(chunk, s.N - n0), ld = B * PQ;
    float* col = grow(tl_col, CRS * ld);
    parallel_for(B, [&](int64_t i) { conv::im2col(u, x + (n0 + i) * CHW, 1, col + i * PQ, ld); });
    uint32_t* pcol = grow(tl_pack_b, bf16_packed_b_words(CRS, ld));
    pack_b_parallel(false, CRS, ld, col, ld, pcol);
    float* out = grow(tl_out, s.K * ld);
    product_parallel({s.K, ld, CRS, pw, pcol, out, ld, false, hardware_dot});
    parallel_for(B, [&](int64_t i) {
      for (int64_t k = 0; k < s.K; ++k) {
        float* yk = y + ((n0 + i) * s.K + k) * PQ;
        const float* ok = out + k * ld + i * PQ;
        const float bias = b ? b[k] : 0.0f;
        for (int64_t j = 0; j < PQ; ++j) yk[j] = ok[j] + bias;
      }
    });
  }
}

void bf16_conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, bool hardware_dot) {
  const conv::Unfold u(s);
  const int64_t CRS = s.C * s.R * s.S, RS = s.R * s.S, PQ = u.P * u.Q, CHW = s.C * s.H * s.W;
  const int64_t chunk = chunk_images(s);
  if (db) {
    parallel_for(s.K, [&](int64_t k) {
      double total = 0.0;
      for (int64_t n = 0; n < s.N; ++n) {
        const float* d = dy + (n * s.K + k) * PQ;
        float part = 0.0f;
        for (int64_t j = 0; j < PQ; ++j) part += d[j];
        total += part;
      }
      db[k] = static_cast<float>(total);
    });
  }
  // W^T (C*R*S, K) packed once for the data gradient.
  uint32_t* pwt = dx ? grow(tl_pack_a, bf16_packed_a_words(CRS, s.K)) : nullptr;
  if (dx) pack_a_parallel(true, CRS, s.K, w, CRS, pwt);
  for (int64_t n0 = 0; n0 < s.N; n0 += chunk) {
    const int64_t B = std::min(chunk, s.N - n0), ld = B * PQ;
    float* dyc = grow(tl_dy, s.K * ld);
    gather_dy(s, dy, n0, B, dyc);
    // dw (+)= dy_chunk (K, B*P*Q) @ patches (B*P*Q, C*R*S).
    float* rows = grow(tl_rows, ld * CRS);
    parallel_for(B, [&](int64_t i) {
      conv::im2col_rows(u, x + (n0 + i) * CHW, 1, rows + i * PQ * CRS);
    });
    uint32_t* pa = grow(tl_pack_dy_a, bf16_packed_a_words(s.K, ld));
    pack_a_parallel(false, s.K, ld, dyc, ld, pa);
    uint32_t* pr = grow(tl_pack_rows, bf16_packed_b_words(ld, CRS));
    pack_b_parallel(false, ld, CRS, rows, CRS, pr);
    product_parallel({s.K, CRS, ld, pa, pr, dw, CRS, n0 > 0, hardware_dot});
    if (!dx) continue;
    // dcol (C*R*S, B*P*Q) = W^T @ dy_chunk, scattered into dx channel by channel.
    uint32_t* pb = grow(tl_pack_dy_b, bf16_packed_b_words(s.K, ld));
    pack_b_parallel(false, s.K, ld, dyc, ld, pb);
    float* dcol = grow(tl_col, CRS * ld);
    product_parallel({CRS, ld, s.K, pwt, pb, dcol, ld, false, hardware_dot});
    float* dxc = dx + n0 * CHW;
    parallel_for(s.C, [&](int64_t c) {
      for (int64_t i = 0; i < B; ++i) {
        std::fill_n(dxc + i * CHW + c * s.H * s.W, s.H * s.W, 0.0f);
      }
      conv::col2im_channel(u, dcol + c * RS * ld, ld, B, c, dxc);
    });
  }
  if (s.N == 0) std::fill_n(dw, s.K * CRS, 0.0f);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
