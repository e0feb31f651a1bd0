// cpp/ops/conv2d_cpu/lanes.cpp -- conv2d with a block of 16 images side by side in vector lanes
// (stride 1, no padding, more than 16 taps: LeNet's conv2): the 16x16 transposes into and out of
// that layout, and register-tiled FMA kernels for forward, dw and dx.
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

// ---- Batch in lanes: 16 images side by side (LeNet's conv2) ----
// For the other convolutions with stride 1 and no padding, a block of 16 images is laid out
// with the image index innermost, x as xT (C, H, W, 16), so one vector holds a pixel of all 16
// images, and the three products run as register tiles of such vectors: output channels x
// output columns (forward), output channels x taps (dw), input channels x input columns (dx).
// Every weight is a broadcast, every image a lane: no im2col matrix, no packing, and the
// arithmetic is all FMAs on full vectors. Each sum runs over a fixed order (forward and dx: the
// taps; dw: the block's pixels, then the 16 lanes in a fixed tree), so the bits depend on the
// shape alone. Missing images of a short last block are zero lanes.
// On the AVX2 path each tile runs twice, over lanes 0-7 and 8-15 (kHalves), with 8-float
// vectors; the sums per lane are the same, so are the bits.
// Tiles: conv2d_cpu.h's kFwdKT and the others (lanes_bf16.cpp's emulation shares them on the
// AVX-512 path).

bool use_lanes(const Conv2dShape& s) {
  return s.stride == 1 && s.pad == 0 && !use_direct(s) &&
         kLaneBlock * (s.C * s.H * s.W + 2 * s.K * s.P() * s.Q()) <= (int64_t{1} << 22);
}

// Transposes a kW x kW tile held as kW row vectors, in place: v[j][i] becomes the old v[i][j].
// Rounds d = kW / 2, ..., 2, 1 swap the off-diagonal d x d blocks: rows a and a + d (bit d of a
// clear) become, block by block, the even-numbered blocks of both rows and the odd-numbered
// ones, one two-input shuffle each. Lane l of the result reads block l / d of x (even) or y (odd).
template <int kD, int kHalf, size_t... kL>
inline V swap_blocks(V x, V y, std::index_sequence<kL...>) {
  return __builtin_shufflevector(
      x, y, static_cast<int>((kL / kD % 2) * kW + kL / kD / 2 * 2 * kD + kHalf * kD + kL % kD)...);
}
template <int kD>
inline void transpose_round(V* v) {
  for (int a = 0; a < kW; ++a) {
    if (a & kD) continue;
    const V x = v[a], y = v[a + kD];
    v[a] = swap_blocks<kD, 0>(x, y, std::make_index_sequence<kW>{});
    v[a + kD] = swap_blocks<kD, 1>(x, y, std::make_index_sequence<kW>{});
  }
}
inline void transpose_tile(V* v) {
  if constexpr (kW == 16) transpose_round<8>(v);
  transpose_round<4>(v);
  transpose_round<2>(v);
  transpose_round<1>(v);
}

// xT (E, 16) from B <= 16 rows of x, rows e_stride floats apart: xT[e, i] = x[i, e], zero for
// i >= B. Sixteen columns at a time through kW x kW transposes, the last E % 16 one by one.
void to_lanes(const float* __restrict x, int64_t e_stride, int64_t B, int64_t E,
              float* __restrict xT) {
  const V zero = {};
  const int64_t full = E / kLaneBlock * kLaneBlock;
  for (int64_t e0 = 0; e0 < full; e0 += kLaneBlock) {
    for (int ib = 0; ib < kLaneBlock; ib += kW) {
      for (int eb = 0; eb < kLaneBlock; eb += kW) {
        V v[kW];
        for (int i = 0; i < kW; ++i) {
          v[i] = ib + i < B ? loadw(x + (ib + i) * e_stride + e0 + eb) : zero;
        }
        transpose_tile(v);
        for (int e = 0; e < kW; ++e) storew(xT + (e0 + eb + e) * kLaneBlock + ib, v[e]);
      }
    }
  }
  for (int64_t e = full; e < E; ++e) {
    float* row = xT + e * kLaneBlock;
    for (int64_t i = 0; i < kLaneBlock; ++i) row[i] = i < B ? x[i * e_stride + e] : 0.0f;
  }
}

// The inverse: x[i, e] = xT[e, i] for i < B.
void from_lanes(const float* __restrict xT, int64_t E, int64_t B, float* __restrict x,
                int64_t e_stride) {
  const int64_t full = E / kLaneBlock * kLaneBlock;
  for (int64_t e0 = 0; e0 < full; e0 += kLaneBlock) {
    for (int ib = 0; ib < kLaneBlock && ib < B; ib += kW) {
      for (int eb = 0; eb < kLaneBlock; eb += kW) {
        V v[kW];
        for (int e = 0; e < kW; ++e) v[e] = loadw(xT + (e0 + eb + e) * kLaneBlock + ib);
        transpose_tile(v);
        for (int i = 0; i < kW && ib + i < B; ++i) storew(x + (ib + i) * e_stride + e0 + eb, v[i]);
      }
    }
  }
  for (int64_t e = full; e < E; ++e) {
    for (int64_t i = 0; i < B; ++i) x[i * e_stride + e] = xT[e * kLaneBlock + i];
  }
}

// w (K, C*R*S) packed for lanes_forward: the output channels in tiles of kFwdKT (the last one
// narrower), each tile's weights (C*R*S, tile width) contiguous from wP + k0 * C*R*S, so a tile
// reads its weights as one sequential stream (with w as (C*R*S, K) every tap's few weights sat in
// a cache line of their own, and the AVX2 tiles, which need twice the passes, ran out of cache
// bandwidth).
void pack_forward_weights(const Conv2dShape& s, const float* __restrict w, float* __restrict wP) {
  const int64_t CRS = s.C * s.R * s.S;
  for (int64_t k0 = 0; k0 < s.K; k0 += kFwdKT) {
    const int64_t nk = std::min<int64_t>(kFwdKT, s.K - k0);
    float* tile = wP + k0 * CRS;
    for (int64_t j = 0; j < CRS; ++j) {
      for (int64_t a = 0; a < nk; ++a) tile[j * nk + a] = w[(k0 + a) * CRS + j];
    }
  }
}

// Forward tile: outT[k0 + a, p, q0 + m] for a < KT, m < QT, summed over the taps (c, r, t) in
// order from zero. wP is w packed by pack_forward_weights (KT is this tile's width).
template <int KT, int QT>
void lanes_forward_tile(const Conv2dShape& s, const float* __restrict xT,
                        const float* __restrict wP, int64_t p, int64_t q0, int64_t k0,
                        float* __restrict outT) {
  const int64_t P = s.P(), Q = s.Q();
  const float* __restrict wtile = wP + k0 * s.C * s.R * s.S;
  for (int h = 0; h < kLaneBlock; h += kW) {
    V acc[KT][QT] = {};
    int64_t j = 0;
    for (int64_t c = 0; c < s.C; ++c) {
      for (int64_t r = 0; r < s.R; ++r) {
        const float* xrow = xT + ((c * s.H + p + r) * s.W + q0) * kLaneBlock + h;
        for (int64_t t = 0; t < s.S; ++t, ++j) {
          V xv[QT];
#pragma GCC unroll 8
          for (int m = 0; m < QT; ++m) xv[m] = loadw(xrow + (t + m) * kLaneBlock);
          const float* wj = wtile + j * KT;
#pragma GCC unroll 8
          for (int a = 0; a < KT; ++a) {
            const float wa = wj[a];
#pragma GCC unroll 8
            for (int m = 0; m < QT; ++m) acc[a][m] += xv[m] * wa;
          }
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

// dw tile: dw[k0 + a, j0 + b] for a < KT, b < JT (j = (c, r, t)) of one block, summed over the
// pixels (p, q) in order, then over the 16 lanes (sum16). xoff[j] is tap j's offset
// (c*H + r)*W + t.
template <int KT, int JT>
void lanes_dw_tile(const Conv2dShape& s, const float* __restrict xT, const float* __restrict dyT,
                   const int64_t* __restrict xoff, int64_t k0, int64_t j0, float* __restrict dw) {
  const int64_t P = s.P(), Q = s.Q(), CRS = s.C * s.R * s.S;
  const int64_t k_step = P * Q * kLaneBlock;
  V part[KT][JT][kHalves];  // each half's sums, added lane by lane at the end
  for (int h = 0; h < kHalves; ++h) {
    V acc[KT][JT] = {};
    const float* xj[JT];
    for (int b = 0; b < JT; ++b) xj[b] = xT + xoff[j0 + b] * kLaneBlock + h * kW;
    for (int64_t p = 0; p < P; ++p) {
      const float* dyrow = dyT + (k0 * P + p) * Q * kLaneBlock + h * kW;
      for (int64_t q = 0; q < Q; ++q) {
        const int64_t pix = (p * s.W + q) * kLaneBlock;
        V d[KT];
#pragma GCC unroll 8
        for (int a = 0; a < KT; ++a) d[a] = loadw(dyrow + a * k_step + q * kLaneBlock);
#pragma GCC unroll 8
        for (int b = 0; b < JT; ++b) {
          const V xv = loadw(xj[b] + pix);
#pragma GCC unroll 8
          for (int a = 0; a < KT; ++a) acc[a][b] += d[a] * xv;
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

// dx tile for interior columns (those that see every tap t): dxT[c0 + a, h, w0 + m] for a < CT,
// m < WT, the sum of w[k, c, r, t] * dyT[k, h - r, w - t] over (k, r, t) in order from zero, r
// in [r_lo, r_hi] (the taps row h sees).
template <int CT, int WT>
void lanes_dx_tile(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                   int64_t h, int64_t r_lo, int64_t r_hi, int64_t w0, int64_t c0,
                   float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q();
  for (int l0 = 0; l0 < kLaneBlock; l0 += kW) {
    V acc[CT][WT] = {};
    for (int64_t k = 0; k < s.K; ++k) {
      for (int64_t r = r_lo; r <= r_hi; ++r) {
        const float* dyrow = dyT + ((k * P + h - r) * Q + w0) * kLaneBlock + l0;
        const float* wkr = w + ((k * s.C + c0) * s.R + r) * s.S;
        for (int64_t t = 0; t < s.S; ++t) {
          V dv[WT];
#pragma GCC unroll 8
          for (int m = 0; m < WT; ++m) dv[m] = loadw(dyrow + (m - t) * kLaneBlock);
#pragma GCC unroll 8
          for (int a = 0; a < CT; ++a) {
            const float wa = wkr[a * s.R * s.S + t];
#pragma GCC unroll 8
            for (int m = 0; m < WT; ++m) acc[a][m] += dv[m] * wa;
          }
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

// dx of one border column v (it sees only the taps t in [t_lo, t_hi]) for CT input channels: the
// sum over (r, t, k) in order from zero, k innermost so the short tap ranges cost no loop
// overhead. Both halves of the 16 lanes go through one pass (AVX2): each weight's broadcast then
// serves two FMAs, where a pass per half was bound by its loads (a broadcast per FMA).
template <int CT>
void lanes_dx_column(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                     int64_t h, int64_t r_lo, int64_t r_hi, int64_t v, int64_t t_lo, int64_t t_hi,
                     int64_t c0, float* __restrict dxT) {
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S, CRS = s.C * RS;
  const int64_t k_step = P * Q * kLaneBlock;
  V acc[CT][kHalves] = {};
  for (int64_t r = r_lo; r <= r_hi; ++r) {
    for (int64_t t = t_lo; t <= t_hi; ++t) {
      const float* dv = dyT + ((h - r) * Q + v - t) * kLaneBlock;
      const float* wv = w + (c0 * s.R + r) * s.S + t;
      for (int64_t k = 0; k < s.K; ++k, dv += k_step, wv += CRS) {
        V d[kHalves];
        for (int l = 0; l < kHalves; ++l) d[l] = loadw(dv + l * kW);
#pragma GCC unroll 16
        for (int a = 0; a < CT; ++a) {
          const float wa = wv[a * RS];
          for (int l = 0; l < kHalves; ++l) acc[a][l] += d[l] * wa;
        }
      }
    }
  }
  for (int a = 0; a < CT; ++a) {
    for (int l = 0; l < kHalves; ++l) {
      storew(dxT + (((c0 + a) * s.H + h) * s.W + v) * kLaneBlock + l * kW, acc[a][l]);
    }
  }
}

// The tile kernels by size, so a tail tile runs the same code with smaller bounds.
constexpr auto kLanesForward = table_1_to<kFwdKT, kFwdQT>(
    [](auto a, auto b) { return &lanes_forward_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kLanesDw = table_1_to<kDwKT, kDwJT>(
    [](auto a, auto b) { return &lanes_dw_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kLanesDx = table_1_to<kDxCT, kDxWT>(
    [](auto a, auto b) { return &lanes_dx_tile<decltype(a)::value, decltype(b)::value>; });
constexpr auto kLanesDxColumn =
    table_1_to<kDxColumnCT>([](auto a) { return &lanes_dx_column<decltype(a)::value>; });

// One block's forward: outT (K, P, Q, 16) from xT and the packed weights.
void lanes_forward(const Conv2dShape& s, const float* xT, const float* wP, float* outT) {
  lanes_forward_loops(kLanesForward, s, xT, wP, outT);
}

// One block's dw (K, C*R*S) from xT and dyT (K, P, Q, 16).
void lanes_dw(const Conv2dShape& s, const float* xT, const float* dyT, const int64_t* xoff,
              float* dw) {
  lanes_dw_loops(kLanesDw, s, xT, dyT, xoff, dw);
}

// One block's dxT (C, H, W, 16) from dyT.
void lanes_dx(const Conv2dShape& s, const float* w, const float* dyT, float* dxT) {
  lanes_dx_loops(kLanesDx, kLanesDxColumn, s, w, dyT, dxT);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
