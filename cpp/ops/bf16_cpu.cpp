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
#include "ops/bf16_round.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

typedef float Vf __attribute__((vector_size(64), aligned(4), may_alias));
using bf16::Vu;
typedef int32_t Vi __attribute__((vector_size(64)));

constexpr int64_t kMr = kBf16Mr, kNr = kBf16Nr;

using bf16::bits_of;
using bf16::float_of;
using bf16::to_bf16;


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

// pack_rows from 16-bit values already rounded: the same words, by shifts (pack_cols and
// pack_parallel take either).
template <int64_t kW>
void pack_rows(const uint16_t* src, int64_t ld, int64_t k, int64_t j0, int64_t width,
               uint32_t* out) {
  const int64_t pairs = bf16_pairs(k), w = std::min(kW, width - j0);
  for (int64_t p = 0; p < pairs; ++p, out += kW) {
    const uint16_t* __restrict r0 = src + 2 * p * ld + j0;
    uint32_t* __restrict o = out;
    if (2 * p + 1 < k) {
      const uint16_t* __restrict r1 = r0 + ld;
      for (int64_t j = 0; j < w; ++j) o[j] = (uint32_t{r1[j]} << 16) | r0[j];
    } else {
      for (int64_t j = 0; j < w; ++j) o[j] = r0[j];
    }
    for (int64_t j = w; j < kW; ++j) o[j] = 0;
  }
}

// The bfloat16 bits of a float32 value, or of a 16-bit value already rounded (itself).
inline uint32_t bf16_bits(float x) { return to_bf16(x); }
inline uint32_t bf16_bits(uint16_t h) { return h; }

template <int64_t kW, typename T>
void pack_cols(const T* src, int64_t ld, int64_t k, int64_t j0, int64_t width, uint32_t* out) {
  const int64_t pairs = bf16_pairs(k), w = std::min(kW, width - j0);
  for (int64_t j = 0; j < kW; ++j) {
    uint32_t* o = out + j;
    if (j >= w) {
      for (int64_t p = 0; p < pairs; ++p) o[p * kW] = 0;
      continue;
    }
    const T* s = src + (j0 + j) * ld;
    for (int64_t p = 0; p < k / 2; ++p) {
      o[p * kW] = (bf16_bits(s[2 * p + 1]) << 16) | bf16_bits(s[2 * p]);
    }
    if (k % 2) o[(pairs - 1) * kW] = bf16_bits(s[k - 1]);
  }
}

// The register tile t (kMr x kNr floats, rows kNr apart) += the product of one packed panel pair
// over `pairs` k pairs, as float32 FMAs: per pair, the odd element's product, then the even one's.
// A sub-tile of kRows x 16 * kVecs at (r0, c0) at a time: 8 x 32 on AVX-512 (16 accumulators);
// the AVX2 path's tile_fma below runs 4 x 16 sub-tiles with the same order of each output's adds.
#if defined(__AVX512F__)
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
  tile_fma_part<8, 2>(pairs, pa, pb, t, 0, 0);
}
#else
// AVX2: a 4 x 16 sub-tile at a time in ymm intrinsics (8 accumulators, the pair's 4 halves of B,
// A's pair word broadcast and split in the vector registers), the same FMAs in the same order.
// (tile_fma_part's 64-byte generic vectors, split into ymm halves by GCC, went through the stack
// on every FMA here: 5-6x slower. Splitting A's word in scalar registers before two broadcasts
// made LeNet's fc1 ~10 % slower than this: 0.71 and 1.02 ms forward and backward against 0.63
// and 0.90, AMD EPYC Zen 4 under MGPU_ISA=avx2, 2026-12-08.)
__attribute__((noinline)) void tile_fma(int64_t pairs, const uint32_t* pa, const uint32_t* pb,
                                        float* t) {
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r0 = 0; r0 < kMr; r0 += 4) {
    for (int64_t c0 = 0; c0 < kNr; c0 += 16) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r) {
        acc[r][0] = _mm256_load_ps(t + (r0 + r) * kNr + c0);
        acc[r][1] = _mm256_load_ps(t + (r0 + r) * kNr + c0 + 8);
      }
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t* b = pb + p * kNr + c0;
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8));
        const __m256 bh0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask));
        const __m256 bh1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask));
        const __m256 bl0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        const __m256 bl1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        for (int r = 0; r < 4; ++r) {
          // The pair word in every lane (one broadcast load), split into its two floats there.
          const __m256i w = _mm256_set1_epi32(static_cast<int>(pa[p * kMr + r0 + r]));
          const __m256 ah = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
          const __m256 al = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
          acc[r][0] = _mm256_fmadd_ps(ah, bh0, acc[r][0]);
          acc[r][0] = _mm256_fmadd_ps(al, bl0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(ah, bh1, acc[r][1]);
          acc[r][1] = _mm256_fmadd_ps(al, bl1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_store_ps(t + (r0 + r) * kNr + c0, acc[r][0]);
        _mm256_store_ps(t + (r0 + r) * kNr + c0 + 8, acc[r][1]);
      }
    }
  }
}
#endif

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
// panels multiplied in (the emulation under FTZ|DAZ, set per tile so that nothing else runs
// under it), the block handed to store(t, i0, j0, rows, cols).
template <class Store>
void product_tile_to(const Bf16Product& q, int64_t ip, int64_t jp, const Store& store) {
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
    const bf16::FlushDenormals ftz(true);
    tile_fma(pairs, pa, pb, t);
  }
#else
  {
    const bf16::FlushDenormals ftz(true);
    tile_fma(pairs, pa, pb, t);
  }
#endif
  store(static_cast<const float*>(t), i0, j0, rows, cols);
}

// The block copied back into c.
void product_tile(const Bf16Product& q, int64_t ip, int64_t jp) {
  product_tile_to(q, ip, jp, [&](const float* t, int64_t i0, int64_t j0, int64_t rows,
                                 int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(t + r * kNr, cols, q.c + (i0 + r) * q.ldc + j0);
  });
}

inline int64_t panels(int64_t n, int64_t w) { return (n + w - 1) / w; }

// Every tile of a product, spread over the device's cores (tiles are independent), each block
// handed to store (product_tile_to).
template <class Store>
void product_parallel_to(const Bf16Product& q, const Store& store) {
  if (q.m == 0 || q.n == 0) return;
  const int64_t mp = panels(q.m, kMr), np = panels(q.n, kNr);
  parallel_for(np, [&](int64_t jp) {
    for (int64_t ip = 0; ip < mp; ++ip) product_tile_to(q, ip, jp, store);
  });
}

void product_parallel(const Bf16Product& q) {
  product_parallel_to(q, [&](const float* t, int64_t i0, int64_t j0, int64_t rows,
                             int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(t + r * kNr, cols, q.c + (i0 + r) * q.ldc + j0);
  });
}

// Packs `width` rows (A, kW = kMr) or columns (B, kW = kNr) of a (width, k) or (k, width)
// operand in panels of kW, one panel per task; `pairs_along_rows` picks pack_rows' layout.
template <int64_t kW, typename T>
void pack_parallel(bool pairs_along_rows, int64_t width, int64_t k, const T* src, int64_t ld,
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
thread_local std::vector<uint32_t> tl_pack_a, tl_pack_b, tl_pack_col_a, tl_pack_dy_b;
thread_local std::vector<float> tl_col, tl_dwt, tl_w_flipped;
thread_local std::vector<uint16_t> tl_x_halves, tl_col_halves, tl_dy_halves;

template <typename T>
T* grow(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// ---- bfloat16 copies for the conv passes ----
// A conv pass rounds its inputs to bfloat16 once, element by element (x, dy), and then builds
// the product's packed panels from those 16-bit copies by moves and shifts alone. Rounding
// commutes with every copy and the padding's zeros round to +0, so the panels hold exactly the
// bits that rounding the float32 im2col matrices would give, at a ninth of the roundings of a
// 3x3 kernel's and half the bytes moved.
typedef uint16_t Vh __attribute__((vector_size(32), aligned(2), may_alias));

// y[i] = the bfloat16 bits of x[i], 16 at a time.
void round_into(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Vu r;
    to_bf16(*reinterpret_cast<const Vu*>(x + i), r);
    *reinterpret_cast<Vh*>(y + i) = __builtin_convertvector(r, Vh);
  }
  for (; i < n; ++i) y[i] = static_cast<uint16_t>(to_bf16(x[i]));
}

// conv::im2col on 16-bit values, channel c's R*S rows: B images xb (B, C, H, W) into col
// (C*R*S, B*P*Q, rows ld apart), zeros in the padding. One thread writes a row whole (threads
// splitting a row's images shared its cache lines). Each output row of a tap is written once, left to right: the
// zeros before its valid span, the span, the zeros after. The span is copied 16 values at a
// time, the last vector running past the span's end where that stays inside the row
// (the zeros after the span, then the next output rows, overwrite what it wrote there; past
// the row are rows another thread writes); xb needs kOverread values of slack for the reads.
constexpr int64_t kOverread = 16;
void im2col_halves(const conv::Unfold& u, const uint16_t* __restrict xb, int64_t B, int64_t c,
                   uint16_t* __restrict col, int64_t ld) {
  const Conv2dShape& s = u.s;
  const int64_t P = u.P, Q = u.Q, CHW = s.C * s.H * s.W, st = s.stride;
  {
    for (int64_t r = 0; r < s.R; ++r) {
      const conv::Span rows = u.rows[r];
      for (int64_t t = 0; t < s.S; ++t) {
        const conv::Span cols = u.cols[t];
        const bool empty = rows.lo == rows.hi || cols.lo == cols.hi;
        const int64_t n = cols.hi - cols.lo;
        uint16_t* __restrict row = col + ((c * s.R + r) * s.S + t) * ld;
        for (int64_t i = 0; i < B; ++i) {
          uint16_t* d = row + i * P * Q;
          const uint16_t* xs = xb + i * CHW + (c * s.H + r - s.pad) * s.W + (t - s.pad);
          for (int64_t p = 0; p < P; ++p, d += Q) {
            if (empty || p < rows.lo || p >= rows.hi) {
              std::fill(d, d + Q, uint16_t{0});
              continue;
            }
            std::fill(d, d + cols.lo, uint16_t{0});
            const uint16_t* src = xs + p * st * s.W + cols.lo * st;
            uint16_t* dst = d + cols.lo;
            if (st == 1) {
              int64_t q = 0;
              const int64_t room = (B - i) * P * Q - (p * Q + cols.lo);
              const int64_t vec_end = (n + 15) / 16 * 16 <= room ? n : n - n % 16;
              for (; q < vec_end; q += 16) {
                *reinterpret_cast<Vh*>(dst + q) = *reinterpret_cast<const Vh*>(src + q);
              }
              for (; q < n; ++q) dst[q] = src[q];
            } else {
              for (int64_t q = 0; q < n; ++q) dst[q] = src[q * st];
            }
            std::fill(d + cols.hi, d + Q, uint16_t{0});
          }
        }
      }
    }
  }
}


// y[i] = x[i] rounded to bfloat16 and widened back to float32 (the low 16 bits zero), on the
// device's cores in chunks of 4096 floats; y may be x.
void round_floats_into(const float* x, int64_t n, float* y) {
  constexpr int64_t kChunk = 4096;
  parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    if (y != x) std::copy(x + i0, x + i1, y + i0);
    bf16::round_in_place(y + i0, i1 - i0);
  });
}

// The same into the calling thread's buffer buf.
const float* rounded_floats(const float* x, int64_t n, std::vector<float>& buf) {
  float* y = grow(buf, n);
  round_floats_into(x, n, y);
  return y;
}

// db (K) from dy rounded to bfloat16 (the dy the products see): a float32 sum per image, the
// images' sums added in double.
void bias_gradient(const Conv2dShape& s, const float* dy, float* db) {
  const int64_t PQ = s.P() * s.Q();
  parallel_for(s.K, [&](int64_t k) {
    double total = 0.0;
    for (int64_t n = 0; n < s.N; ++n) {
      const float* d = dy + (n * s.K + k) * PQ;
      float part = 0.0f;
      for (int64_t j = 0; j < PQ; ++j) part += float_of(to_bf16(d[j]) << 16);
      total += part;
    }
    db[k] = static_cast<float>(total);
  });
}

// How a bf16 conv pass runs under algo. auto and tune take float32's kernels on operands rounded
// to bfloat16: float32 Winograd F(4x4, 3x3) on the shapes where float32's auto takes it (it
// rounds x and dy as it reads them), float32's rule elsewhere (rounding x and dy in its blocks'
// copies of them: conv2d_cpu.h's rule_forward_bf16; the rule's lane shapes run
// conv2d_cpu/lanes_bf16.cpp's pair products, which has its figures). Measured with
// bench conv (AMD EPYC Zen 4, 2 threads, batch 64): Winograd beat both bfloat16 kernels at every
// ResNet-18 3x3 stride-1 layer; at the stride-2 layers the bf16 products (vdpbf16ps) beat
// float32's im2col + sgemm at 128 and 256 input channels (16 against 21 ms forward, 19 against
// 26) but not at 64 (31 against 21) nor at the 1x1 shortcuts, and on the AVX2 path, whose
// products are float32 FMAs, they lost everywhere (24 against 14 ms at 128 channels). The route
// must be a function of the shape alone, the same on every path (its bits), so auto never takes
// the products. direct and im2col take them (the GPU kernels' bits).
enum class Bf16Route { Products, RoundedWinograd, RoundedRule };
Bf16Route bf16_route(const Conv2dShape& s, ConvAlgo algo) {
  if (algo != ConvAlgo::Auto && algo != ConvAlgo::Tune) return Bf16Route::Products;
  return conv::winograd_by_auto(s) ? Bf16Route::RoundedWinograd : Bf16Route::RoundedRule;
}

thread_local std::vector<float> tl_w_rounded;

// x's images n0 .. n0 + B rounded, on the device's cores.
const uint16_t* round_images(const float* x, int64_t n0, int64_t B, int64_t CHW,
                             std::vector<uint16_t>& buf) {
  uint16_t* xb = grow(buf, B * CHW + kOverread);
  parallel_for(B, [&](int64_t i) { round_into(x + (n0 + i) * CHW, CHW, xb + i * CHW); });
  return xb;
}

// dy's chunk of images n0 .. n0 + B rounded as one (K, B * P * Q) matrix, image i in columns
// i * PQ...
void gather_dy_halves(const Conv2dShape& s, const float* dy, int64_t n0, int64_t B,
                      uint16_t* out) {
  const int64_t PQ = s.P() * s.Q(), ld = B * PQ;
  parallel_for(s.K, [&](int64_t k) {
    for (int64_t i = 0; i < B; ++i) {
      round_into(dy + ((n0 + i) * s.K + k) * PQ, PQ, out + k * ld + i * PQ);
    }
  });
}

// Images per chunk of a conv pass: enough for ~2048 product columns (B * P * Q), between 1 and
// 64; a function of the shape alone, so the order of dw's sums never depends on the threads.
int64_t chunk_images(const Conv2dShape& s) {
  const int64_t pq = s.P() * s.Q();
  return std::clamp<int64_t>((2048 + pq - 1) / pq, 1, 64);
}

}  // namespace

void bf16_round(int64_t n, const float* x, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<uint16_t>(to_bf16(x[i]));
}

void bf16_round_floats(int64_t n, const float* x, float* y) { round_floats_into(x, n, y); }

bool bf16_rounds_for_rule(const Conv2dShape& s, ConvAlgo algo) {
  return bf16_route(s, algo) == Bf16Route::RoundedRule;
}

void bf16_pack_a(bool trans, int64_t m, int64_t k, const float* a, int64_t lda, uint32_t* out) {
  pack_a_parallel(trans, m, k, a, lda, out);
}

void bf16_pack_b(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, uint32_t* out) {
  pack_b_parallel(trans, k, n, b, ldb, out);
}

void bf16_product(const Bf16Product& q) {
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
                         float* y, bool hardware_dot, ConvAlgo algo) {
  const Bf16Route route = bf16_route(s, algo);
  if (route != Bf16Route::Products) {
    const float* wr = rounded_floats(w, s.K * s.C * s.R * s.S, tl_w_rounded);
    if (route == Bf16Route::RoundedWinograd) return conv::winograd_forward(s, x, wr, b, y, true);
    return conv::rule_forward_bf16(s, x, wr, b, y, hardware_dot);
  }
  if (conv::winograd_bf16_chosen(s, algo)) {
    return conv::winograd_bf16_forward(s, x, w, b, y, hardware_dot);
  }
  const conv::Unfold u(s);
  const int64_t CRS = s.C * s.R * s.S, PQ = u.P * u.Q, CHW = s.C * s.H * s.W;
  const int64_t chunk = chunk_images(s);
  uint32_t* pw = grow(tl_pack_a, bf16_packed_a_words(s.K, CRS));
  pack_a_parallel(false, s.K, CRS, w, CRS, pw);
  for (int64_t n0 = 0; n0 < s.N; n0 += chunk) {
    const int64_t B = std::min(chunk, s.N - n0), ld = B * PQ;
    const uint16_t* xb = round_images(x, n0, B, CHW, tl_x_halves);
    uint16_t* col = grow(tl_col_halves, CRS * ld);
    parallel_for(s.C, [&](int64_t c) { im2col_halves(u, xb, B, c, col, ld); });
    uint32_t* pcol = grow(tl_pack_b, bf16_packed_b_words(CRS, ld));
    pack_parallel<kNr>(true, ld, CRS, col, ld, pcol);
    // Each block goes straight to y's images (a block's columns may span two or more), + b.
    product_parallel_to({s.K, ld, CRS, pw, pcol, nullptr, 0, false, hardware_dot},
                        [&](const float* t, int64_t i0, int64_t j0, int64_t rows, int64_t cols) {
      for (int64_t j = 0; j < cols;) {
        const int64_t img = (j0 + j) / PQ, pq = (j0 + j) % PQ, n = std::min(cols - j, PQ - pq);
        for (int64_t r = 0; r < rows; ++r) {
          const float bias = b ? b[i0 + r] : 0.0f;
          float* __restrict dst = y + ((n0 + img) * s.K + i0 + r) * PQ + pq;
          const float* __restrict src = t + r * kNr + j;
          for (int64_t e = 0; e < n; ++e) dst[e] = src[e] + bias;
        }
        j += n;
      }
    });
  }
}

void bf16_conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, bool hardware_dot, ConvAlgo algo) {
  const conv::Unfold u(s);
  const int64_t CRS = s.C * s.R * s.S, RS = s.R * s.S, PQ = u.P * u.Q, CHW = s.C * s.H * s.W;
  const int64_t chunk = chunk_images(s);
  // The rounded routes give every output of float32's pass on the rounded operands, db (the
  // sum of the rounded dy) included.
  const Bf16Route route = bf16_route(s, algo);
  if (route == Bf16Route::RoundedWinograd) {
    const float* wr = rounded_floats(w, s.K * CRS, tl_w_rounded);
    return conv::winograd_backward(s, x, wr, dy, dx, dw, db, true);
  }
  if (route == Bf16Route::RoundedRule) {
    const float* wr = rounded_floats(w, s.K * CRS, tl_w_rounded);
    return conv::rule_backward_bf16(s, x, wr, dy, dx, dw, db, hardware_dot);
  }
  if (db) bias_gradient(s, dy, db);
  // A stride-1 square kernel's data gradient is a convolution itself: dy padded by R-1-pad
  // with the kernel flipped and its channels swapped, run after the loop through the forward
  // pass, whose packing reads dy once instead of writing and re-reading a float32 dcol. Other
  // shapes take W^T @ dy and col2im in the loop.
  const bool dx_as_forward = dx && s.stride == 1 && s.R == s.S && s.pad <= s.R - 1;
  float* const dx_loop = dx_as_forward ? nullptr : dx;
  // W^T (C*R*S, K) packed once for the data gradient.
  uint32_t* pwt = dx_loop ? grow(tl_pack_a, bf16_packed_a_words(CRS, s.K)) : nullptr;
  if (dx_loop) pack_a_parallel(true, CRS, s.K, w, CRS, pwt);
  // dw^T (C*R*S, K), summed over the chunks in order; dw is its transpose.
  float* dwt = grow(tl_dwt, CRS * s.K);
  for (int64_t n0 = 0; n0 < s.N; n0 += chunk) {
    const int64_t B = std::min(chunk, s.N - n0), ld = B * PQ;
    uint16_t* dyh = grow(tl_dy_halves, s.K * ld);
    gather_dy_halves(s, dy, n0, B, dyh);
    // dw^T (+)= col (C*R*S, B*P*Q) @ dy_chunk^T: im2col's layout, the pairs along a row of col
    // and of dy. Each weight's sum is dw = dy_chunk @ col^T's, pair for pair (a product of two
    // bfloat16 values is exact, so the operands' order within a pair changes no bit).
    const uint16_t* xb = round_images(x, n0, B, CHW, tl_x_halves);
    uint16_t* col = grow(tl_col_halves, CRS * ld);
    parallel_for(s.C, [&](int64_t c) { im2col_halves(u, xb, B, c, col, ld); });
    uint32_t* pc = grow(tl_pack_col_a, bf16_packed_a_words(CRS, ld));
    pack_parallel<kMr>(false, CRS, ld, col, ld, pc);
    uint32_t* pd = grow(tl_pack_dy_b, bf16_packed_b_words(ld, s.K));
    pack_parallel<kNr>(false, s.K, ld, dyh, ld, pd);
    product_parallel({CRS, s.K, ld, pc, pd, dwt, s.K, n0 > 0, hardware_dot});
    if (!dx_loop) continue;
    // dcol (C*R*S, B*P*Q) = W^T @ dy_chunk, scattered into dx channel by channel.
    uint32_t* pb = grow(tl_pack_dy_b, bf16_packed_b_words(s.K, ld));
    pack_parallel<kNr>(true, ld, s.K, dyh, ld, pb);
    float* dcol = grow(tl_col, CRS * ld);
    product_parallel({CRS, ld, s.K, pwt, pb, dcol, ld, false, hardware_dot});
    float* dxc = dx_loop + n0 * CHW;
    parallel_for(s.C, [&](int64_t c) {
      for (int64_t i = 0; i < B; ++i) {
        std::fill_n(dxc + i * CHW + c * s.H * s.W, s.H * s.W, 0.0f);
      }
      conv::col2im_channel(u, dcol + c * RS * ld, ld, B, c, dxc);
    });
  }
  if (s.N == 0) std::fill_n(dwt, s.K * CRS, 0.0f);
  parallel_for(s.K, [&](int64_t k) {
    for (int64_t j = 0; j < CRS; ++j) dw[k * CRS + j] = dwt[j * s.K + k];
  });
  if (!dx_as_forward) return;
  // dx = conv(dy, w'), w' (C, K, R, S) the kernel flipped in both axes, channels swapped.
  float* wf = grow(tl_w_flipped, s.K * CRS);
  parallel_for(s.C, [&](int64_t c) {
    for (int64_t k = 0; k < s.K; ++k) {
      for (int64_t r = 0; r < s.R; ++r) {
        for (int64_t t = 0; t < s.S; ++t) {
          wf[((c * s.K + k) * s.R + r) * s.S + t] =
              w[((k * s.C + c) * s.R + (s.R - 1 - r)) * s.S + (s.S - 1 - t)];
        }
      }
    }
  });
  const Conv2dShape t{s.N, s.K, u.P, u.Q, s.C, s.R, s.S, 1, s.R - 1 - s.pad};
  bf16_conv2d_forward(t, dy, wf, nullptr, dx, hardware_dot, algo);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
