// cpp/ops/conv2d_cpu/lanes_bf16.cpp -- lanes.cpp's convolutions (16 images side by side in
// vector lanes: LeNet's conv2) with bfloat16 products (ops/bf16.h), for precision bf16.
//
// vdpbf16ps multiplies pairs: each 32-bit lane holds two bfloat16 values of one image and adds
// both products to that lane's float32 sum, the high half's first. So each pass pairs the terms
// of its sums: the forward pairs input channels (2cp + 1, 2cp), dx output channels (2kp + 1, 2kp)
// and dw adjacent output columns (q + 1, q), with x read at every tap as the column pair
// (x[w + 1], x[w]). A missing partner (odd C, K or Q, a column past the row) is a zero. Every
// output is then the sum, in the loops' order, of pairs each added high product first.
//
// Two ways to compute it, the same bits on every path and thread count:
// - hw (the AVX-512 path where the CPU has AVX512_BF16): the operands packed as vdpbf16ps reads
//   them, a 32-bit word per image and pair, and lanes.cpp's register tiles with a word where it
//   has a float: half the multiply instructions, each doing two.
// - emu (every other path): lanes.cpp's float32 kernels on the rounded lanes themselves, their
//   loops visiting the terms pair by pair, high term first, each an FMA, under MXCSR.FTZ|DAZ.
//   That is what vdpbf16ps computes (bf16.h), with float32's tiles and loads; a missing partner
//   is an FMA of the same zero.
// The operands arrive rounded to bfloat16 (the lanes of x and dy, and w): the packing keeps their
// top halves. The hw code alone is compiled for AVX512_BF16, so the emulation never meets it.
//
// Measured at LeNet's conv2 (batch 256, 20 -> 50 channels, 5x5 on 13x13; AMD EPYC Zen 4, 2
// threads, CPU time, float32's lane kernels against these, interleaved, 2026-12-07): hw 1.6x
// float32 forward, 1.35x dw (of its 9 columns' 5 pairs, the last is half padding), 2x dx; the
// LeNet step 1.5-1.6x. The emulation on the AVX2 path does float32's FMAs in another order, so
// at best float32's speed: one block, one thread, MGPU_ISA=avx2 on the same CPU (2026-12-08),
// 0.93x float32 forward, 0.91x dw (which adds the padding's tenth column), 0.9x dx; the LeNet
// step 0.9x of float32's (the first version of these tiles, before the sliding windows, the flat
// border-column loop and the padding on the add ports: 0.75-0.8x; float32's lane kernels on the
// rounded operands, before the pair products: 0.9-1.0x). The price of one set of bits on every
// path.
#include <immintrin.h>

#include <vector>

#include "ops/bf16_round.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

namespace {

// ---- emu: float32 FMAs on the rounded lanes, in vdpbf16ps's order ----
// The emulation's tiles. AVX-512: lanes.cpp's. AVX2 (16 ymm registers): 5 x 2 forward and dx
// tiles (10 accumulators and two 2-column windows), 3 x 4 dw, 5 channels per dx border column,
// chosen by single-thread runs of one block of LeNet's conv2 against 3 x 3, 4 x 2, 3 x 2, 6 x 2
// and 6 x 1 forward, 2 x 5, 3 x 3 and 4 x 2 dx, 4 x 3, 2 x 6, 5 x 2 and 2 x 5 dw, 3, 4 and 6
// column channels (AMD EPYC Zen 4 under MGPU_ISA=avx2, 2026-12-08). They can be set at compile
// time, to time alternatives.
#ifndef MGPU_EMU_FWD_KT
#define MGPU_EMU_FWD_KT 5
#define MGPU_EMU_FWD_QT 2
#endif
#ifndef MGPU_EMU_DX_CT
#define MGPU_EMU_DX_CT 5
#define MGPU_EMU_DX_WT 2
#endif
#ifndef MGPU_EMU_DW_KT
#define MGPU_EMU_DW_KT 3
#define MGPU_EMU_DW_JT 4
#endif
#ifndef MGPU_EMU_DX_COLUMN_CT
#define MGPU_EMU_DX_COLUMN_CT 5
#endif
#if defined(__AVX512F__)
constexpr int kEmuFwdKT = kFwdKT, kEmuFwdQT = kFwdQT, kEmuDxCT = kDxCT, kEmuDxWT = kDxWT;
constexpr int kEmuDwKT = kDwKT, kEmuDwJT = kDwJT, kEmuDxColumnCT = kDxColumnCT;
#else
constexpr int kEmuFwdKT = MGPU_EMU_FWD_KT, kEmuFwdQT = MGPU_EMU_FWD_QT;
constexpr int kEmuDxCT = MGPU_EMU_DX_CT, kEmuDxWT = MGPU_EMU_DX_WT;
constexpr int kEmuDwKT = MGPU_EMU_DW_KT, kEmuDwJT = MGPU_EMU_DW_JT;
constexpr int kEmuDxColumnCT = MGPU_EMU_DX_COLUMN_CT;
#endif

inline V fma_v(V a, V b, V c) {
#if defined(__AVX512F__)
  return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}
// v itself, hidden from the optimizer, so that adding it is not contracted with the multiply
// that made it into an FMA. (The emulated AVX-512 build of the tests, whose 16-float vectors fit
// no register, skips the barrier: the bits are the same either way, and its speed is not timed.)
inline V opaque(V v) {
#if !defined(MGPU_AVX512_EMULATED)
  asm("" : "+x"(v));
#endif
  return v;
}
// *p in every lane, a -0 kept (V{} + x would make it +0).
inline V broadcast_v(const float* p) {
#if defined(__AVX512F__)
  return (V)_mm512_set1_ps(*p);
#else
  return (V)_mm256_broadcast_ss(p);
#endif
}

// w packed for emu_forward_tile: output channels in tiles of kEmuFwdKT (the last narrower), tile
// k0's weights from wE + k0 * ceil(C/2) * R * S * 2; for each (channel pair, r, t) in order, the
// tile's high channel's weights, then its low channel's (a missing high channel's are zeros).
void pack_forward_emu(const Conv2dShape& s, const float* __restrict w, float* __restrict wE) {
  const int64_t Cp = (s.C + 1) / 2, RS = s.R * s.S, CRS = s.C * RS;
  for (int64_t k0 = 0; k0 < s.K; k0 += kEmuFwdKT) {
    const int64_t nk = std::min<int64_t>(kEmuFwdKT, s.K - k0);
    float* tile = wE + k0 * Cp * RS * 2;
    for (int64_t cp = 0; cp < Cp; ++cp) {
      for (int64_t rs = 0; rs < RS; ++rs) {
        float* dst = tile + 2 * (cp * RS + rs) * nk;
        for (int64_t a = 0; a < nk; ++a) {
          const float* wk = w + (k0 + a) * CRS + rs;
          dst[a] = 2 * cp + 1 < s.C ? wk[(2 * cp + 1) * RS] : 0.0f;
          dst[nk + a] = wk[2 * cp * RS];
        }
      }
    }
  }
}

// Forward tile: outT[k0 + a, p, q0 + m] for a < KT, m < QT from xT (C, H, W, 16), the sum over
// (channel pair, r, t) in order, the high channel's product first. Along t each channel's row is
// read through a window of QT columns that slides by one: a new load per tap and channel, not QT
// (as GCC makes of lanes.cpp's float32 tile by itself; with the two channels' terms interleaved
// it reloaded every column, and the tile ran ~0.8x float32's on the AVX2 path).
template <int KT, int QT>
void emu_forward_tile(const Conv2dShape& s, const float* __restrict xT,
                      const float* __restrict wE, int64_t p, int64_t q0, int64_t k0,
                      float* __restrict outT) {
  const int64_t P = s.P(), Q = s.Q(), E = s.H * s.W, Cp = (s.C + 1) / 2;
  const float* __restrict wtile = wE + k0 * Cp * s.R * s.S * 2;
  for (int h = 0; h < kLaneBlock; h += kW) {
    V acc[KT][QT] = {};
    // One channel's products at a tap: its window xv (columns t .. t + QT - 1), weights wa[0, KT).
    auto term = [&](const V (&xv)[QT], const float* wa) {
#pragma GCC unroll 8
      for (int a = 0; a < KT; ++a) {
        const V w = broadcast_v(wa + a);
#pragma GCC unroll 8
        for (int m = 0; m < QT; ++m) acc[a][m] = fma_v(xv[m], w, acc[a][m]);
      }
    };
    const float* wj = wtile;
    for (int64_t cp = 0; cp < Cp; ++cp) {
      const bool has_hi = 2 * cp + 1 < s.C;
      const float* xlo = xT + 2 * cp * E * kLaneBlock + h;
      const float* xhi = xlo + E * kLaneBlock;
      for (int64_t r = 0; r < s.R; ++r) {
        const int64_t row = ((p + r) * s.W + q0) * kLaneBlock;
        // The windows before tap 0: columns -1 .. QT - 2 (slot 0 is shifted out unread).
        V xh[QT], xl[QT];
#pragma GCC unroll 8
        for (int m = 1; m < QT; ++m) {
          xh[m] = has_hi ? loadw(xhi + row + (m - 1) * kLaneBlock) : V{};
          xl[m] = loadw(xlo + row + (m - 1) * kLaneBlock);
        }
        for (int64_t t = 0; t < s.S; ++t, wj += 2 * KT) {
#pragma GCC unroll 8
          for (int m = 0; m + 1 < QT; ++m) {
            xh[m] = xh[m + 1];
            xl[m] = xl[m + 1];
          }
          const int64_t last = row + (t + QT - 1) * kLaneBlock;
          xh[QT - 1] = has_hi ? loadw(xhi + last) : V{};
          xl[QT - 1] = loadw(xlo + last);
          term(xh, wj);  // a missing high channel: zero x times zero weights
          term(xl, wj + KT);
        }
      }
    }
    for (int a = 0; a < KT; ++a) {
      for (int m = 0; m < QT; ++m) {
        storew(outT + (((k0 + a) * P + p) * Q + q0 + m) * kLaneBlock + h, acc[a][m]);
      }
    }
  }
}

// dw tile: dw[k0 + a, j0 + b] for a < KT, b < JT (j = (c, r, t), xoff[j] its offset
// (c*H + r)*W + t) of one block: per lane the sum over (p, column pair) in order, column q + 1's
// product before column q's, then the 16 lanes added by sum16. For odd Q the last pair's high
// term is a zero dy times x at column Q + t (a zero past the row's end), as hw packs it.
template <int KT, int JT>
void emu_dw_tile(const Conv2dShape& s, const float* __restrict xT, const float* __restrict dyT,
                 const int64_t* __restrict xoff, int64_t k0, int64_t j0, float* __restrict dw) {
  const int64_t P = s.P(), Q = s.Q(), CRS = s.C * s.R * s.S;
  const int64_t k_step = P * Q * kLaneBlock;
  bool hi_in_row[JT];
  for (int b = 0; b < JT; ++b) hi_in_row[b] = Q + xoff[j0 + b] % s.W < s.W;
  V part[KT][JT][kHalves];
  for (int h = 0; h < kHalves; ++h) {
    V acc[KT][JT] = {};
    const float* xj[JT];
    for (int b = 0; b < JT; ++b) xj[b] = xT + xoff[j0 + b] * kLaneBlock + h * kW;
    for (int64_t p = 0; p < P; ++p) {
      const float* dyrow = dyT + (k0 * P + p) * Q * kLaneBlock + h * kW;
      const int64_t xrow = p * s.W * kLaneBlock;
      for (int64_t q = 0; q < Q; q += 2) {
#pragma GCC unroll 2
        for (int64_t e = 1; e >= 0; --e) {  // column q + 1's products, then column q's
          const int64_t qe = q + e;
          if (qe == Q) {  // past the last column: a zero dy times x at column Q + t
            for (int b = 0; b < JT; ++b) {
              const V xv = hi_in_row[b] ? loadw(xj[b] + xrow + qe * kLaneBlock) : V{};
              // fma(0, x, acc) as acc + (0 * x), the same value (0 * x is exact), on the add
              // ports where the CPU has them apart from the FMA ports (AMD Zen).
              const V zx = opaque(V{} * xv);
              for (int a = 0; a < KT; ++a) acc[a][b] = acc[a][b] + zx;
            }
            continue;
          }
          V d[KT];
#pragma GCC unroll 8
          for (int a = 0; a < KT; ++a) d[a] = loadw(dyrow + a * k_step + qe * kLaneBlock);
#pragma GCC unroll 8
          for (int b = 0; b < JT; ++b) {
            const V xv = loadw(xj[b] + xrow + qe * kLaneBlock);
#pragma GCC unroll 8
            for (int a = 0; a < KT; ++a) acc[a][b] = fma_v(d[a], xv, acc[a][b]);
          }
        }
      }
    }
    for (int a = 0; a < KT; ++a) {
      for (int b = 0; b < JT; ++b) part[a][b][h] = acc[a][b];
    }
  }
  for (int a = 0; a < KT; ++a) {
    for (int b = 0; b < JT; ++b) dw[(k0 + a) * CRS + j0 + b] = sum16(part[a][b]);
  }
}

// dx tile for interior columns: dxT[c0 + a, h, w0 + m] for a < CT, m < WT, the sum over
// (output-channel pair, r, t) in order, r in [r_lo, r_hi], the high channel's product first.
// Column w0 + m reads dy at column w0 + m - t: along t each channel's dy row is read through a
// window of WT columns that slides by one (as emu_forward_tile's x).
template <int CT, int WT>
void emu_dx_tile(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                 int64_t h, int64_t r_lo, int64_t r_hi, int64_t w0, int64_t c0,
                 float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S, CRS = s.C * RS;
  const int64_t k_step = P * Q * kLaneBlock;
  for (int l0 = 0; l0 < kLaneBlock; l0 += kW) {
    V acc[CT][WT] = {};
    // One output channel's products at a tap: its window dv, weights wk[a * RS].
    auto term = [&](const V (&dv)[WT], const float* wk) {
#pragma GCC unroll 8
      for (int a = 0; a < CT; ++a) {
        const V wa = broadcast_v(wk + a * RS);
#pragma GCC unroll 8
        for (int m = 0; m < WT; ++m) acc[a][m] = fma_v(dv[m], wa, acc[a][m]);
      }
    };
    for (int64_t kp = 0; kp < (s.K + 1) / 2; ++kp) {
      const bool has_hi = 2 * kp + 1 < s.K;
      for (int64_t r = r_lo; r <= r_hi; ++r) {
        const float* dlo = dyT + ((2 * kp * P + h - r) * Q + w0) * kLaneBlock + l0;
        const float* dhi = dlo + k_step;
        const float* wlo = w + ((2 * kp * s.C + c0) * s.R + r) * s.S;
        // The windows before tap 0: columns w0 + 1 .. w0 + WT (the last is shifted out unread).
        V dh[WT], dl[WT];
#pragma GCC unroll 8
        for (int m = 0; m + 1 < WT; ++m) {
          dh[m] = has_hi ? loadw(dhi + (m + 1) * kLaneBlock) : V{};
          dl[m] = loadw(dlo + (m + 1) * kLaneBlock);
        }
        for (int64_t t = 0; t < s.S; ++t) {
#pragma GCC unroll 8
          for (int m = WT - 1; m > 0; --m) {
            dh[m] = dh[m - 1];
            dl[m] = dl[m - 1];
          }
          dl[0] = loadw(dlo - t * kLaneBlock);
          if (has_hi) {
            dh[0] = loadw(dhi - t * kLaneBlock);
            term(dh, wlo + CRS + t);
          } else {  // the missing channel: a zero dy times a zero weight
            for (int a = 0; a < CT; ++a) {
              for (int m = 0; m < WT; ++m) acc[a][m] = fma_v(V{}, V{}, acc[a][m]);
            }
          }
          term(dl, wlo + t);
        }
      }
    }
    for (int a = 0; a < CT; ++a) {
      for (int m = 0; m < WT; ++m) {
        storew(dxT + (((c0 + a) * s.H + h) * s.W + w0 + m) * kLaneBlock + l0, acc[a][m]);
      }
    }
  }
}

// acc[a] += one output channel's dy (both halves of the lanes at de) times its weights we[a * RS].
template <int CT>
__attribute__((always_inline)) inline void column_term(V (&acc)[CT * kHalves], const float* de,
                                                       const float* we, int64_t RS) {
  V d[kHalves];
#pragma GCC unroll 2
  for (int l = 0; l < kHalves; ++l) d[l] = loadw(de + l * kW);
#pragma GCC unroll 16
  for (int a = 0; a < CT; ++a) {
    const V wa = broadcast_v(we + a * RS);
#pragma GCC unroll 2
    for (int l = 0; l < kHalves; ++l) acc[a * kHalves + l] = fma_v(d[l], wa, acc[a * kHalves + l]);
  }
}

// Each thread's list of a border column's taps (emu_dx_column).
thread_local std::vector<int64_t> tl_column_taps;

// dx of one border column v (taps t in [t_lo, t_hi]) for CT input channels: the sum over
// (output-channel pair, r, t) in order, both halves of the lanes in one pass; an odd K's last
// pair (a zero term, then channel K - 1's) in a loop of its own. The taps (r, t) the column sees
// are listed first, so that one flat loop runs over (pair, tap): with the pair, r and t loops
// nested (1 to 4 taps t per row at LeNet's conv2) dx took ~9 % longer on the AVX2 path.
template <int CT>
void emu_dx_column(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                   int64_t h, int64_t r_lo, int64_t r_hi, int64_t v, int64_t t_lo, int64_t t_hi,
                   int64_t c0, float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S, CRS = s.C * RS;
  const int64_t k_step = P * Q * kLaneBlock;
  // Tap i's offsets from channel k's dy plane and weights, in (r, t) order: at most R * S each.
  if (static_cast<int64_t>(tl_column_taps.size()) < 2 * RS) {
    tl_column_taps.resize(static_cast<size_t>(2 * RS));
  }
  int64_t* __restrict d_off = tl_column_taps.data();
  int64_t* __restrict w_off = d_off + RS;
  int64_t taps = 0;
  for (int64_t r = r_lo; r <= r_hi; ++r) {
    for (int64_t t = t_lo; t <= t_hi; ++t, ++taps) {
      d_off[taps] = ((h - r) * Q + v - t) * kLaneBlock;
      w_off[taps] = (c0 * s.R + r) * s.S + t;
    }
  }
  V acc[CT * kHalves] = {};
  // dk and wk: channel k's dy plane and weights, k the pair's low channel.
  const float* dk = dyT;
  const float* wk = w;
  for (int64_t n = 0, i = 0; n < s.K / 2 * taps; ++n) {
    column_term<CT>(acc, dk + k_step + d_off[i], wk + CRS + w_off[i], RS);  // channel k + 1's
    column_term<CT>(acc, dk + d_off[i], wk + w_off[i], RS);
    if (++i == taps) {
      i = 0;
      dk += 2 * k_step;
      wk += 2 * CRS;
    }
  }
  if (s.K % 2 == 1) {  // the last channel's pair: a zero term, then channel K - 1's
    for (int64_t i = 0; i < taps; ++i) {
      for (int a = 0; a < CT * kHalves; ++a) acc[a] = fma_v(V{}, V{}, acc[a]);
      column_term<CT>(acc, dk + d_off[i], wk + w_off[i], RS);
    }
  }
  for (int a = 0; a < CT; ++a) {
    for (int l = 0; l < kHalves; ++l) {
      storew(dxT + (((c0 + a) * s.H + h) * s.W + v) * kLaneBlock + l * kW, acc[a * kHalves + l]);
    }
  }
}

// ---- hw: vdpbf16ps on packed pairs ----
#if defined(__AVX512F__)
using bf16::bits_of;

// A pair of two 16-lane rows of rounded floats (hi null: zeros) as vdpbf16ps reads it: per
// image a 32-bit word, the high row's bfloat16 in its top half.
inline void put_pair(uint32_t* __restrict dst, const float* __restrict hi,
                     const float* __restrict lo) {
  for (int l = 0; l < 16; ++l) {
    dst[l] = (hi ? bits_of(hi[l]) & 0xffff0000u : 0u) | (bits_of(lo[l]) >> 16);
  }
}
inline uint32_t weight_pair(float hi, float lo) {
  return (bits_of(hi) & 0xffff0000u) | (bits_of(lo) >> 16);
}

// xP (ceil(C/2), E) channel pairs of lanes xT (C, E, 16).
void pack_channel_pairs(const float* __restrict xT, int64_t C, int64_t E,
                        uint32_t* __restrict out) {
  for (int64_t cp = 0; cp < (C + 1) / 2; ++cp) {
    const float* lo = xT + 2 * cp * E * kLaneBlock;
    const float* hi = 2 * cp + 1 < C ? lo + E * kLaneBlock : nullptr;
    for (int64_t e = 0; e < E; ++e) {
      put_pair(out + (cp * E + e) * kLaneBlock, hi ? hi + e * kLaneBlock : nullptr,
               lo + e * kLaneBlock);
    }
  }
}

// The column pairs (row[q + 1], row[q]) of nrows rows of `width` lane elements, `pairs` per row:
// q = step * i (step 2: dy's column pairs; step 1: x's pair at every column). A partner past the
// row's end is a zero.
void pack_column_pairs(const float* __restrict rows, int64_t nrows, int64_t width, int64_t pairs,
                       int64_t step, uint32_t* __restrict out) {
  for (int64_t i = 0; i < nrows; ++i) {
    const float* row = rows + i * width * kLaneBlock;
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t q = step * j;
      put_pair(out + (i * pairs + j) * kLaneBlock,
               q + 1 < width ? row + (q + 1) * kLaneBlock : nullptr, row + q * kLaneBlock);
    }
  }
}

// wP: output channels in tiles of kFwdKT, tile k0's (ceil(C/2), R, S, nk) pairs from
// wP + k0 * ceil(C/2) * R * S.
void pack_forward_hw(const Conv2dShape& s, const float* w, uint32_t* wP) {
  const int64_t Cp = (s.C + 1) / 2, RS = s.R * s.S, CRS = s.C * RS;
  for (int64_t k0 = 0; k0 < s.K; k0 += kFwdKT) {
    const int64_t nk = std::min<int64_t>(kFwdKT, s.K - k0);
    uint32_t* tile = wP + k0 * Cp * RS;
    for (int64_t j = 0; j < Cp * RS; ++j) {
      const int64_t cp = j / RS, rs = j % RS;
      for (int64_t a = 0; a < nk; ++a) {
        const float* wk = w + (k0 + a) * CRS + rs;
        tile[j * nk + a] =
            weight_pair(2 * cp + 1 < s.C ? wk[(2 * cp + 1) * RS] : 0.0f, wk[2 * cp * RS]);
      }
    }
  }
}

// wD (ceil(K/2), C, R, S): pairs (w[2kp + 1, c, r, t], w[2kp, c, r, t]).
void pack_dx_hw(const Conv2dShape& s, const float* w, uint32_t* wD) {
  const int64_t CRS = s.C * s.R * s.S;
  for (int64_t kp = 0; kp < (s.K + 1) / 2; ++kp) {
    for (int64_t j = 0; j < CRS; ++j) {
      wD[kp * CRS + j] =
          weight_pair(2 * kp + 1 < s.K ? w[(2 * kp + 1) * CRS + j] : 0.0f, w[2 * kp * CRS + j]);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")
inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
inline __m512i load_pairs(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline __m512i broadcast_pair(const uint32_t* p) {
  return _mm512_set1_epi32(static_cast<int>(*p));
}

// emu_forward_tile's sums from xP (ceil(C/2), H, W) pairs and pack_forward_hw's weights.
template <int KT, int QT>
void hw_forward_tile(const Conv2dShape& s, const uint32_t* __restrict xP,
                     const uint32_t* __restrict wP, int64_t p, int64_t q0, int64_t k0,
                     float* __restrict outT) {
  const int64_t P = s.P(), Q = s.Q(), Cp = (s.C + 1) / 2;
  const uint32_t* __restrict wtile = wP + k0 * Cp * s.R * s.S;
  __m512 acc[KT][QT];
  for (int a = 0; a < KT; ++a) {
    for (int m = 0; m < QT; ++m) acc[a][m] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (int64_t cp = 0; cp < Cp; ++cp) {
    for (int64_t r = 0; r < s.R; ++r) {
      const uint32_t* xrow = xP + ((cp * s.H + p + r) * s.W + q0) * kLaneBlock;
      for (int64_t t = 0; t < s.S; ++t, ++j) {
        __m512i xv[QT];
#pragma GCC unroll 8
        for (int m = 0; m < QT; ++m) xv[m] = load_pairs(xrow + (t + m) * kLaneBlock);
        const uint32_t* wj = wtile + j * KT;
#pragma GCC unroll 8
        for (int a = 0; a < KT; ++a) {
          const __m512i wa = broadcast_pair(wj + a);
#pragma GCC unroll 8
          for (int m = 0; m < QT; ++m) acc[a][m] = dot(acc[a][m], xv[m], wa);
        }
      }
    }
  }
  for (int a = 0; a < KT; ++a) {
    for (int m = 0; m < QT; ++m) {
      _mm512_storeu_ps(outT + (((k0 + a) * P + p) * Q + q0 + m) * kLaneBlock, acc[a][m]);
    }
  }
}

// emu_dw_tile's sums from xS (C, H, W) column pairs (x[w + 1], x[w]) and dyQ (K, P, ceil(Q/2))
// column pairs.
template <int KT, int JT>
void hw_dw_tile(const Conv2dShape& s, const uint32_t* __restrict xS,
                const uint32_t* __restrict dyQ, const int64_t* __restrict xoff, int64_t k0,
                int64_t j0, float* __restrict dw) {
  const int64_t P = s.P(), Qp = (s.Q() + 1) / 2, CRS = s.C * s.R * s.S;
  const int64_t k_step = P * Qp * kLaneBlock;
  __m512 acc[KT][JT];
  for (int a = 0; a < KT; ++a) {
    for (int b = 0; b < JT; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  const uint32_t* xj[JT];
  for (int b = 0; b < JT; ++b) xj[b] = xS + xoff[j0 + b] * kLaneBlock;
  for (int64_t p = 0; p < P; ++p) {
    const uint32_t* dyrow = dyQ + (k0 * P + p) * Qp * kLaneBlock;
    for (int64_t qp = 0; qp < Qp; ++qp) {
      const int64_t pix = (p * s.W + 2 * qp) * kLaneBlock;
      __m512i d[KT];
#pragma GCC unroll 8
      for (int a = 0; a < KT; ++a) d[a] = load_pairs(dyrow + a * k_step + qp * kLaneBlock);
#pragma GCC unroll 8
      for (int b = 0; b < JT; ++b) {
        const __m512i xv = load_pairs(xj[b] + pix);
#pragma GCC unroll 8
        for (int a = 0; a < KT; ++a) acc[a][b] = dot(acc[a][b], d[a], xv);
      }
    }
  }
  for (int a = 0; a < KT; ++a) {
    for (int b = 0; b < JT; ++b) {
      const V part = (V)acc[a][b];
      dw[(k0 + a) * CRS + j0 + b] = sum16(&part);
    }
  }
}

// emu_dx_tile's sums from dyK (ceil(K/2), P, Q) channel pairs and pack_dx_hw's weights.
template <int CT, int WT>
void hw_dx_tile(const Conv2dShape& s, const uint32_t* __restrict wD,
                const uint32_t* __restrict dyK, int64_t h, int64_t r_lo, int64_t r_hi, int64_t w0,
                int64_t c0, float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S;
  __m512 acc[CT][WT];
  for (int a = 0; a < CT; ++a) {
    for (int m = 0; m < WT; ++m) acc[a][m] = _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < (s.K + 1) / 2; ++kp) {
    for (int64_t r = r_lo; r <= r_hi; ++r) {
      const uint32_t* dyrow = dyK + ((kp * P + h - r) * Q + w0) * kLaneBlock;
      const uint32_t* wkr = wD + ((kp * s.C + c0) * s.R + r) * s.S;
      for (int64_t t = 0; t < s.S; ++t) {
        __m512i dv[WT];
#pragma GCC unroll 8
        for (int m = 0; m < WT; ++m) dv[m] = load_pairs(dyrow + (m - t) * kLaneBlock);
#pragma GCC unroll 8
        for (int a = 0; a < CT; ++a) {
          const __m512i wa = broadcast_pair(wkr + a * RS + t);
#pragma GCC unroll 8
          for (int m = 0; m < WT; ++m) acc[a][m] = dot(acc[a][m], dv[m], wa);
        }
      }
    }
  }
  for (int a = 0; a < CT; ++a) {
    for (int m = 0; m < WT; ++m) {
      _mm512_storeu_ps(dxT + (((c0 + a) * s.H + h) * s.W + w0 + m) * kLaneBlock, acc[a][m]);
    }
  }
}

// emu_dx_column's sums from dyK and pack_dx_hw's weights.
template <int CT>
void hw_dx_column(const Conv2dShape& s, const uint32_t* __restrict wD,
                  const uint32_t* __restrict dyK, int64_t h, int64_t r_lo, int64_t r_hi, int64_t v,
                  int64_t t_lo, int64_t t_hi, int64_t c0, float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S;
  __m512 acc[CT];
  for (int a = 0; a < CT; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < (s.K + 1) / 2; ++kp) {
    for (int64_t r = r_lo; r <= r_hi; ++r) {
      for (int64_t t = t_lo; t <= t_hi; ++t) {
        const __m512i d = load_pairs(dyK + ((kp * P + h - r) * Q + v - t) * kLaneBlock);
        const uint32_t* wv = wD + ((kp * s.C + c0) * s.R + r) * s.S + t;
#pragma GCC unroll 16
        for (int a = 0; a < CT; ++a) acc[a] = dot(acc[a], d, broadcast_pair(wv + a * RS));
      }
    }
  }
  for (int a = 0; a < CT; ++a) {
    _mm512_storeu_ps(dxT + (((c0 + a) * s.H + h) * s.W + v) * kLaneBlock, acc[a]);
  }
}

constexpr auto kHwForward = table_1_to<kFwdKT, kFwdQT>(
    [](auto a, auto b) { return &hw_forward_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kHwDw = table_1_to<kDwKT, kDwJT>(
    [](auto a, auto b) { return &hw_dw_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kHwDx = table_1_to<kDxCT, kDxWT>(
    [](auto a, auto b) { return &hw_dx_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kHwDxColumn =
    table_1_to<kDxColumnCT>([](auto a) { return &hw_dx_column<decltype(a)::value>; });
#pragma GCC pop_options
#endif

constexpr auto kEmuForward = table_1_to<kEmuFwdKT, kEmuFwdQT>(
    [](auto a, auto b) { return &emu_forward_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kEmuDw = table_1_to<kEmuDwKT, kEmuDwJT>(
    [](auto a, auto b) { return &emu_dw_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kEmuDx = table_1_to<kEmuDxCT, kEmuDxWT>(
    [](auto a, auto b) { return &emu_dx_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kEmuDxColumn =
    table_1_to<kEmuDxColumnCT>([](auto a) { return &emu_dx_column<decltype(a)::value>; });

// The calling thread's packed weights and each worker's packed lanes.
thread_local std::vector<uint32_t> tl_weight_words, tl_words;
thread_local std::vector<float> tl_weight_floats;

template <typename T>
T* grow(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

}  // namespace

LanesBf16Weights lanes_bf16_forward_weights(const Conv2dShape& s, const float* w,
                                            bool hardware_dot) {
  const int64_t pairs = s.K * ((s.C + 1) / 2) * s.R * s.S;
#if defined(__AVX512F__)
  if (hardware_dot) {
    uint32_t* wP = grow(tl_weight_words, pairs);
    pack_forward_hw(s, w, wP);
    return {wP, nullptr};
  }
#endif
  float* wE = grow(tl_weight_floats, 2 * pairs);
  pack_forward_emu(s, w, wE);
  return {nullptr, wE};
}

LanesBf16Weights lanes_bf16_dx_weights(const Conv2dShape& s, const float* w, bool hardware_dot) {
#if defined(__AVX512F__)
  if (hardware_dot) {
    uint32_t* wD = grow(tl_weight_words, (s.K + 1) / 2 * s.C * s.R * s.S);
    pack_dx_hw(s, w, wD);
    return {wD, nullptr};
  }
#endif
  return {nullptr, w};  // the emulation reads w itself
}

void lanes_bf16_forward(const Conv2dShape& s, const float* xT, const LanesBf16Weights& wP,
                        float* outT, bool hardware_dot) {
#if defined(__AVX512F__)
  if (hardware_dot) {
    const int64_t E = s.H * s.W;
    uint32_t* xP = grow(tl_words, (s.C + 1) / 2 * E * kLaneBlock);
    pack_channel_pairs(xT, s.C, E, xP);
    return lanes_forward_loops(kHwForward, s, xP, wP.words, outT);
  }
#endif
  const bf16::FlushDenormals ftz(true);
  lanes_forward_loops(kEmuForward, s, xT, wP.floats, outT);
}

void lanes_bf16_backward(const Conv2dShape& s, const float* xT, const float* dyT,
                         const int64_t* xoff, const LanesBf16Weights& wD, float* dw, float* dxT,
                         bool hardware_dot) {
#if defined(__AVX512F__)
  if (hardware_dot) {
    const int64_t P = s.P(), Q = s.Q(), Qp = (Q + 1) / 2;
    const int64_t nx = s.C * s.H * s.W, ndq = s.K * P * Qp;
    const int64_t ndk = dxT ? (s.K + 1) / 2 * P * Q : 0;
    uint32_t* xS = grow(tl_words, (nx + ndq + ndk) * kLaneBlock);
    uint32_t* dyQ = xS + nx * kLaneBlock;
    pack_column_pairs(xT, s.C * s.H, s.W, s.W, 1, xS);
    pack_column_pairs(dyT, s.K * P, Q, Qp, 2, dyQ);
    lanes_dw_loops(kHwDw, s, xS, dyQ, xoff, dw);
    if (!dxT) return;
    uint32_t* dyK = dyQ + ndq * kLaneBlock;
    pack_channel_pairs(dyT, s.K, P * Q, dyK);
    return lanes_dx_loops(kHwDx, kHwDxColumn, s, wD.words, dyK, dxT);
  }
#endif
  const bf16::FlushDenormals ftz(true);
  lanes_dw_loops(kEmuDw, s, xT, dyT, xoff, dw);
  if (dxT) lanes_dx_loops<true>(kEmuDx, kEmuDxColumn, s, wD.floats, dyT, dxT);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
