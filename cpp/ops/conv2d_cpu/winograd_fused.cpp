// cpp/ops/conv2d_cpu/winograd_fused.cpp -- Winograd F(4x4, 3x3)'s forward products with the
// transforms fused around them (winograd.cpp has the algebra): y = A^T [U (.) (B^T d B)] A + bias
// for a 3x3 stride-1 conv with pad <= 2, given U (36, K, C) already transformed.
//
// The T tiles of the batch (image after image, tiles row-major in each) are cut into blocks of
// Tb = 32 or 64 tiles (block_tiles: a function of the shape alone). Each block is one task of
// parallel_for, on one thread, in three steps through that thread's scratch:
//   1. the input transform of the block's tiles, channel after channel, into the panel
//      V (36, C, Tb): for each point, C rows of Tb tiles side by side. Each chunk of 16 tiles
//      is read by masked gathers (zeros in the padding), the next channels prefetched;
//   2. for each point xi, M[xi] (K, Tb) = U[xi] (K, C) * V[xi] (C, Tb) by a register-tiled
//      micro-kernel: kKR output channels x kTR tiles of accumulators, one broadcast weight and
//      kTV vectors of tiles per input channel. U is read where it lies: kKR rows of U[xi],
//      each contiguous over C, are the kKR broadcast streams (no packing pass over U, which is
//      36 MB at 512 channels);
//   3. the output transform of M (36, K, Tb) plus the bias, straight into y.
// Each point's slice of V and M starts kPointPad floats after the one before ends: slices a
// power of two apart (C Tb floats: 8 KB at 64 channels) put the 36 points' rows of one chunk,
// which steps 1 and 3 write and read together, into one L1 set (8 or 12 ways for 36 lines).
// V[xi] (C x Tb floats, <= 128 KB) stays in L2 while the kernel sweeps K over it; the kKR rows
// of U[xi] (<= 16 KB at 512 channels) stay in L1 while it sweeps the block's tiles.
// Scratch per thread, grown once to the largest shape and reused: 144 (C + K) Tb bytes and 4.5 KB
// of padding for V and M (ResNet-18's layers: 0.6 MB at 64 channels, 1.2 MB at 128, 4.7 MB at
// 256, 9.4 MB at 512) and ~2 KB per 16 tiles of geometry.
//
// Same bits on both instruction-set paths and for every thread count: every output is the chain
// acc = fma(U[xi][k][c], V[xi][c][t], acc) over each 32 channels c in order from acc = 0, the
// chains' sums added in order, whatever the register tile (AVX-512: 8 channels x 2 zmm of 16
// tiles; AVX2: 6 x 2 ymm of 8), and the transforms run 16 tiles side by side in lanes with every
// add and multiply rounded on its own (this file compiles with -ffp-contract=off), the same
// operations in every lane.
#include <immintrin.h>

#include <cmath>

#include "core/parallel.h"
#include "ops/bf16_round.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

namespace {

constexpr int kTile = 4;    // outputs per tile side
constexpr int kAlpha = 6;   // transformed tile side
constexpr int kPoints = kAlpha * kAlpha;
constexpr int kL = 16;      // tiles per transform chunk (lanes)

// ---- The micro-kernel's vectors ----
#if defined(__AVX512F__)
constexpr int kVW = 16;  // floats per vector
constexpr int kKR = 8;   // output channels per register tile (8 x 2 = 16 zmm accumulators)
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#else
constexpr int kVW = 8;
constexpr int kKR = 6;   // 6 x 2 = 12 ymm accumulators, 2 tile vectors and a broadcast
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#endif
constexpr int kTV = 2;             // tile vectors per register tile
constexpr int kTR = kTV * kVW;     // tiles per register tile: 32 (AVX-512) or 16 (AVX2)
constexpr int64_t kTileQuantum = 32;  // blocks hold a multiple of this many tiles (>= kTR)

// Input channels per partial sum of the micro-kernel (a constant, so the bits depend on the
// shape alone). One FMA chain over all of C doubled the normwise error of the 512-channel
// layer's forward and dx against float64 (1.2e-5 and 1.8e-5, worst of 3 seeds); chains of 32
// channels, their sums added in order, give <= 4.9e-6 at every ResNet-18 layer and cost one
// load and store of the accumulators per 32 channels.
constexpr int64_t kChainC = 32;

// m[r][t] = sum over c of u[r][c] * v[c * ldv + t], for r < rows and the kTR tiles t: an FMA
// chain over each kChainC channels in order from 0, the chains' sums added in order. Rows
// r >= rows of u repeat the last row (not stored).
inline void product_tile(const float* const* u, const float* __restrict v, int64_t ldv,
                         int64_t C, float* __restrict m, int64_t ldm, int rows) {
  for (int64_t c0 = 0; c0 < C; c0 += kChainC) {
    const int64_t c1 = std::min(C, c0 + kChainC);
    Vec acc[kKR][kTV];
    for (int r = 0; r < kKR; ++r) {
      for (int j = 0; j < kTV; ++j) acc[r][j] = vzero();
    }
    for (int64_t c = c0; c < c1; ++c) {
      Vec vv[kTV];
      for (int j = 0; j < kTV; ++j) vv[j] = vload(v + c * ldv + j * kVW);
      for (int r = 0; r < kKR; ++r) {
        const Vec ub = vbroadcast(u[r] + c);
        for (int j = 0; j < kTV; ++j) acc[r][j] = vfma(ub, vv[j], acc[r][j]);
      }
    }
    // Constant bounds and a test per row, so acc is indexed by constants only and stays in
    // registers: with a loop bounded by the variable rows GCC keeps acc in memory on the AVX2
    // path, 12 stores after every channel's FMAs, which halves the kernel's speed.
    for (int r = 0; r < kKR; ++r) {
      if (r >= rows) break;
      for (int j = 0; j < kTV; ++j) {
        float* dst = m + r * ldm + j * kVW;
        vstore(dst, c0 == 0 ? acc[r][j] : vadd(vload(dst), acc[r][j]));
      }
    }
  }
}

// ---- The transforms, 16 tiles side by side (the formulas of winograd.cpp) ----
// r = B^T d along one axis, for six lane rows (winograd.cpp gives B^T).
inline void input_1d(const float (*d)[kL], float (*r)[kL]) {
  for (int l = 0; l < kL; ++l) {
    const float d0 = d[0][l], d1 = d[1][l], d2 = d[2][l], d3 = d[3][l], d4 = d[4][l],
                d5 = d[5][l];
    const float p = d3 - d1, q = d4 - d2;
    r[0][l] = (2.0f * (d0 + d4) + 3.0f * p) - 4.0f * d2;
    r[1][l] = (2.0f * (d4 - d1) + d2) + 5.0f * d3;
    r[2][l] = (2.0f * (d4 + d1) + d3) - 5.0f * d2;
    r[3][l] = 2.0f * p + q;
    r[4][l] = 2.0f * q - p;
    r[5][l] = (2.0f * (d1 + d5) + 3.0f * q) - 4.0f * d3;
  }
}

// o = A^T m along one axis (6 -> 4).
inline void output_1d(const float (*m)[kL], float (*o)[kL]) {
  for (int l = 0; l < kL; ++l) {
    const float m0 = m[0][l], m1 = m[1][l], m2 = m[2][l], m3 = m[3][l], m4 = m[4][l],
                m5 = m[5][l];
    const float s12 = m1 + m2, d12 = m1 - m2;
    o[0][l] = (m0 + s12) + (m3 + m4);
    o[1][l] = d12 + (0.5f * m3 - 2.0f * m4);
    o[2][l] = s12 + (0.25f * m3 + 4.0f * m4);
    o[3][l] = (d12 + (0.125f * m3 - 8.0f * m4)) + m5;
  }
}

// Where a tile reads and writes: the index in x (channel 0) of its 6x6 input patch's corner
// (which may lie in the padding), the rows [a0, a1) and columns [b0, b1) of the patch inside
// the image, the index in y (channel 0) of its 4x4 output corner and how many of its output
// rows and columns lie inside the output.
struct TileGeo {
  int64_t xoff, yoff;
  int a0, a1, b0, b1, pr, qr;
};

// Per-thread scratch, grown to the largest shape and then reused: the panels V (36 x C x Tb)
// and M (36 x K x Tb) and the block's tile geometry.
inline thread_local std::vector<float> tl_vpanel, tl_mpanel;
inline thread_local std::vector<TileGeo> tl_geo;

// Tiles per block: a multiple of kTileQuantum from the shape alone. 32 tiles keep V[xi] of 512
// channels at 64 KB; blocks of 64 tiles halve the passes over U, which matter where U
// (36 K C floats) outgrows L2 (4 MB), as long as V[xi] (C x 64 floats) stays within 128 KB.
int64_t block_tiles(const Conv2dShape& s) {
  const bool big_u = int64_t{kPoints} * s.K * s.C * 4 > (int64_t{4} << 20);
  return big_u && 2 * kTileQuantum * s.C * 4 <= (int64_t{128} << 10) ? 2 * kTileQuantum
                                                                        : kTileQuantum;
}

// A chunk of kL tiles as the gathers see it: the index in x (channel 0) of its first tile's
// image, each lane's offset from there (int32: the chunk's tiles lie within 16 images, which
// winograd_fits keeps below 2^30 floats), and the masks of the patch rows and columns inside the
// image (-1 inside, 0 in the padding or past the block's last tile).
struct ChunkGeo {
  int64_t base;
  alignas(64) int32_t off[kL];
  alignas(64) int32_t rows[kAlpha][kL];
  alignas(64) int32_t cols[kAlpha][kL];
};

inline thread_local std::vector<ChunkGeo> tl_chunk;
inline thread_local std::vector<int64_t> tl_lines;
constexpr int64_t kPrefetchChannels = 2;
constexpr int64_t kPointPad = 16;  // floats between the points' slices of V and M (see the top)

// From one point's slice of a panel (36, channels, Tb) to the next's.
inline int64_t point_step(int64_t channels, int64_t Tb) { return channels * Tb + kPointPad; }

// d[a][b][l] = the patch of lane l at row a, column b, or 0 where it lies in the padding or
// past the block's last tile: masked vector gathers, one per patch element for all kL lanes;
// xb is the chunk's base in the channel.
inline void gather_patch(const float* xb, int64_t W, const ChunkGeo& cg,
                         float (*d)[kAlpha][kL]) {
#if defined(__AVX512F__)
  const __m512i off = _mm512_load_si512(cg.off);
  for (int a = 0; a < kAlpha; ++a) {
    const __m512i rm = _mm512_load_si512(cg.rows[a]);
    for (int b = 0; b < kAlpha; ++b) {
      const __mmask16 m = _mm512_test_epi32_mask(rm, _mm512_load_si512(cg.cols[b]));
      _mm512_store_ps(d[a][b], _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, off,
                                                        xb + a * W + b, 4));
    }
  }
#else
  for (int h = 0; h < kL; h += 8) {
    const __m256i off = _mm256_load_si256(reinterpret_cast<const __m256i*>(cg.off + h));
    for (int a = 0; a < kAlpha; ++a) {
      const __m256i rm = _mm256_load_si256(reinterpret_cast<const __m256i*>(cg.rows[a] + h));
      for (int b = 0; b < kAlpha; ++b) {
        const __m256i cm = _mm256_load_si256(reinterpret_cast<const __m256i*>(cg.cols[b] + h));
        const __m256 m = _mm256_castsi256_ps(_mm256_and_si256(rm, cm));
        _mm256_store_ps(d[a][b] + h, _mm256_mask_i32gather_ps(_mm256_setzero_ps(),
                                                              xb + a * W + b, off, m, 4));
      }
    }
  }
#endif
}

// The input transform of one block: V[xi][c][t] for its nt tiles (geo) and channel c, lanes
// t >= nt up to the next multiple of kTileQuantum set to 0.
void transform_block_input(const Conv2dShape& s, const float* __restrict x, const TileGeo* geo,
                           const ChunkGeo* chunk, const int64_t* lines, int64_t nlines,
                           int64_t nt, int64_t Tb, float* __restrict vp, bool round_bf16) {
  const int64_t v_step = point_step(s.C, Tb);
  const int64_t HW = s.H * s.W, W = s.W, C = s.C;
  const int64_t chunks = (nt + kTileQuantum - 1) / kTileQuantum * (kTileQuantum / kL);
  for (int64_t c = 0; c < C; ++c) {
    const float* __restrict xc = x + c * HW;
    if (c + kPrefetchChannels < C) {
      const float* xn = xc + kPrefetchChannels * HW;
      for (int64_t i = 0; i < nlines; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(xn + lines[i]), _MM_HINT_T0);
      }
    }
    for (int64_t q = 0; q < chunks; ++q) {
      const int64_t t0 = q * kL;
      alignas(64) float d[kAlpha][kAlpha][kL];
      const ChunkGeo& cg = chunk[q];
      gather_patch(xc + cg.base, W, cg, d);
      if (round_bf16) bf16::round_vectors(&d[0][0][0], kAlpha * kAlpha * kL / 16);
      alignas(64) float col[kAlpha][kL], rt[kAlpha][kL], tr[kAlpha][kAlpha][kL];
      for (int b = 0; b < kAlpha; ++b) {  // along the rows: tr[.][b] = B^T d[.][b]
        for (int a = 0; a < kAlpha; ++a) {
          for (int l = 0; l < kL; ++l) col[a][l] = d[a][b][l];
        }
        input_1d(col, rt);
        for (int a = 0; a < kAlpha; ++a) {
          for (int l = 0; l < kL; ++l) tr[a][b][l] = rt[a][l];
        }
      }
      for (int a = 0; a < kAlpha; ++a) {  // along the columns, into the panel
        input_1d(tr[a], rt);
        for (int b = 0; b < kAlpha; ++b) {
          float* dst = vp + (a * kAlpha + b) * v_step + c * Tb + t0;
          for (int l = 0; l < kL; ++l) dst[l] = rt[b][l];
        }
      }
    }
  }
}

// r[l][b] = o[b][l] for the 4 columns b of one output row of 16 tiles: a 4 x 4 transpose in
// every 128-bit lane (4 tiles at a time), so each tile's row is then one 16-byte store.
inline void tiles_to_rows(const float (*o)[kL], float (*r)[kTile]) {
  for (int h = 0; h < kL; h += kVW) {
    const Vec b0 = vload(o[0] + h), b1 = vload(o[1] + h), b2 = vload(o[2] + h),
              b3 = vload(o[3] + h);
    // Per 128-bit lane: interleave the low / high pairs of b0, b1 and of b2, b3, then the low /
    // high halves of those (unpack{lo,hi}_ps, then unpack{lo,hi}_pd).
#if defined(__AVX512F__)
#define MGPU_LO(a, b) \
  __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, \
                          8, 24, 9, 25, 12, 28, 13, 29)
#define MGPU_HI(a, b) \
  __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, \
                          10, 26, 11, 27, 14, 30, 15, 31)
#define MGPU_LO2(a, b) \
  __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, \
                          8, 9, 24, 25, 12, 13, 28, 29)
#define MGPU_HI2(a, b) \
  __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, \
                          10, 11, 26, 27, 14, 15, 30, 31)
#else
#define MGPU_LO(a, b) __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13)
#define MGPU_HI(a, b) __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15)
#define MGPU_LO2(a, b) __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
#define MGPU_HI2(a, b) __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15)
#endif
    const Vec t0 = MGPU_LO(b0, b1), t1 = MGPU_HI(b0, b1), t2 = MGPU_LO(b2, b3),
              t3 = MGPU_HI(b2, b3);
    const Vec q[4] = {MGPU_LO2(t0, t2), MGPU_HI2(t0, t2), MGPU_LO2(t1, t3), MGPU_HI2(t1, t3)};
#undef MGPU_LO
#undef MGPU_HI
#undef MGPU_LO2
#undef MGPU_HI2
    // q[i] holds, in its 128-bit lane j, tile h + 4 j + i's row.
    alignas(64) float tmp[4][kVW];
    for (int i = 0; i < 4; ++i) vstore(tmp[i], q[i]);
    for (int j = 0; j < kVW / 4; ++j) {
      for (int i = 0; i < 4; ++i) {
        _mm_store_ps(r[h + 4 * j + i], _mm_load_ps(tmp[i] + 4 * j));
      }
    }
  }
}

// The output transform of one block: y = A^T M A + bias for its nt tiles, every output channel.
void transform_block_output(const Conv2dShape& s, const float* __restrict mp, const TileGeo* geo,
                            int64_t nt, int64_t Tb, const float* b, float* __restrict y) {
  const int64_t m_step = point_step(s.K, Tb);
  const int64_t K = s.K, Q = s.Q(), PQ = s.P() * Q;
  for (int64_t k = 0; k < K; ++k) {
    const float bias = b ? b[k] : 0.0f;
    for (int64_t t0 = 0; t0 < nt; t0 += kL) {
      alignas(64) float mm[kAlpha][kAlpha][kL];
      for (int a = 0; a < kAlpha; ++a) {
        for (int bb = 0; bb < kAlpha; ++bb) {
          const float* src = mp + (a * kAlpha + bb) * m_step + k * Tb + t0;
          for (int l = 0; l < kL; ++l) mm[a][bb][l] = src[l];
        }
      }
      alignas(64) float sa[kAlpha][kTile][kL], o[kTile][kL], col[kAlpha][kL];
      for (int a = 0; a < kAlpha; ++a) output_1d(mm[a], sa[a]);  // along the columns
      alignas(64) float out[kTile][kTile][kL];
      for (int bb = 0; bb < kTile; ++bb) {  // along the rows
        for (int a = 0; a < kAlpha; ++a) {
          for (int l = 0; l < kL; ++l) col[a][l] = sa[a][bb][l];
        }
        output_1d(col, o);
        for (int a = 0; a < kTile; ++a) {
          for (int l = 0; l < kL; ++l) out[a][bb][l] = o[a][l] + bias;
        }
      }
      alignas(64) float rows[kTile][kL][kTile];  // rows[a][l] = output row a of tile l
      for (int a = 0; a < kTile; ++a) tiles_to_rows(out[a], rows[a]);
      const int64_t n = std::min<int64_t>(kL, nt - t0);
      for (int64_t l = 0; l < n; ++l) {
        const TileGeo& g = geo[t0 + l];
        float* dst = y + k * PQ + g.yoff;
        if (g.qr == kTile) {
          for (int a = 0; a < g.pr; ++a) {
            _mm_storeu_ps(dst + a * Q, _mm_load_ps(rows[a][l]));
          }
        } else {
          for (int a = 0; a < g.pr; ++a) {
            for (int bb = 0; bb < g.qr; ++bb) dst[a * Q + bb] = rows[a][l][bb];
          }
        }
      }
    }
  }
}

}  // namespace

void winograd_fused_forward(const Conv2dShape& s, const float* x, const float* U, const float* b,
                            float* y, bool round_bf16) {
  const int64_t P = s.P(), Q = s.Q(), C = s.C, K = s.K;
  const int64_t rows = (P + kTile - 1) / kTile, cols = (Q + kTile - 1) / kTile;
  const int64_t per_image = rows * cols, T = s.N * per_image;
  if (T == 0 || K == 0) return;
  const int64_t Tb = block_tiles(s);
  const int64_t blocks = (T + Tb - 1) / Tb;
  parallel_for(blocks, [&](int64_t blk) {
    const int64_t g0 = blk * Tb, nt = std::min(Tb, T - g0);
    if (static_cast<int64_t>(tl_geo.size()) < Tb) tl_geo.resize(static_cast<size_t>(Tb));
    TileGeo* geo = tl_geo.data();
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t g = g0 + t, n = g / per_image, j = g % per_image;
      const int64_t p0 = (j / cols) * kTile, q0 = (j % cols) * kTile;
      const int64_t h0 = p0 - s.pad, w0 = q0 - s.pad;
      TileGeo& e = geo[t];
      e.xoff = n * C * s.H * s.W + h0 * s.W + w0;
      e.a0 = static_cast<int>(std::clamp<int64_t>(-h0, 0, kAlpha));
      e.a1 = static_cast<int>(std::clamp<int64_t>(s.H - h0, e.a0, kAlpha));
      e.b0 = static_cast<int>(std::clamp<int64_t>(-w0, 0, kAlpha));
      e.b1 = static_cast<int>(std::clamp<int64_t>(s.W - w0, e.b0, kAlpha));
      e.yoff = n * K * P * Q + p0 * Q + q0;
      e.pr = static_cast<int>(std::min<int64_t>(kTile, P - p0));
      e.qr = static_cast<int>(std::min<int64_t>(kTile, Q - q0));
    }
    const int64_t chunks = (nt + kTileQuantum - 1) / kTileQuantum * (kTileQuantum / kL);
    if (static_cast<int64_t>(tl_chunk.size()) < chunks) {
      tl_chunk.resize(static_cast<size_t>(chunks));
    }
    ChunkGeo* chunk = tl_chunk.data();
    for (int64_t q = 0; q < chunks; ++q) {
      ChunkGeo& cg = chunk[q];
      const int64_t t0 = q * kL;
      cg.base = std::min(g0 + t0, T - 1) / per_image * C * s.H * s.W;  // its first image
      for (int l = 0; l < kL; ++l) {
        const int64_t t = t0 + l;
        const bool live = t < nt;
        const int64_t rel = live ? geo[t].xoff - cg.base : 0;
        cg.off[l] = static_cast<int32_t>(rel);
        for (int a = 0; a < kAlpha; ++a) {
          cg.rows[a][l] = live && a >= geo[t].a0 && a < geo[t].a1 ? -1 : 0;
          cg.cols[a][l] = live && a >= geo[t].b0 && a < geo[t].b1 ? -1 : 0;
        }
      }
    }
    // Where in x (channel 0) the block reads: each patch row's first float, every 16th after it
    // and its last, deduplicated, prefetched kPrefetchChannels channels ahead. The hardware
    // prefetchers do not follow the gathers' jumps from plane to plane (prefetching took the
    // input transform of 64 channels at 28x28 from ~42 to ~27 ms of CPU per batch of 256).
    tl_lines.clear();
    for (int64_t t = 0; t < nt; ++t) {
      for (int a = geo[t].a0; a < geo[t].a1; ++a) {
        const int64_t first = geo[t].xoff + a * s.W + geo[t].b0;
        const int64_t last = first + geo[t].b1 - geo[t].b0 - 1;
        for (int64_t e = first; e < last; e += 16) tl_lines.push_back(e);
        tl_lines.push_back(last);
      }
    }
    std::sort(tl_lines.begin(), tl_lines.end());
    tl_lines.erase(std::unique(tl_lines.begin(), tl_lines.end()), tl_lines.end());
    const int64_t v_step = point_step(C, Tb), m_step = point_step(K, Tb);
    float* vp = scratch(tl_vpanel, kPoints * v_step);
    float* mp = scratch(tl_mpanel, kPoints * m_step);
    transform_block_input(s, x, geo, chunk, tl_lines.data(),
                          static_cast<int64_t>(tl_lines.size()), nt, Tb, vp, round_bf16);
    const int64_t nt_r = (nt + kTR - 1) / kTR * kTR;  // <= the zeroed lanes of V
    for (int xi = 0; xi < kPoints; ++xi) {
      const float* uxi = U + xi * K * C;
      const float* vxi = vp + xi * v_step;
      float* mxi = mp + xi * m_step;
      for (int64_t k0 = 0; k0 < K; k0 += kKR) {
        const int r_valid = static_cast<int>(std::min<int64_t>(kKR, K - k0));
        const float* u[kKR];
        for (int r = 0; r < kKR; ++r) u[r] = uxi + std::min<int64_t>(k0 + r, K - 1) * C;
        for (int64_t t0 = 0; t0 < nt_r; t0 += kTR) {
          product_tile(u, vxi + t0, Tb, C, mxi + k0 * Tb + t0, Tb, r_valid);
        }
      }
    }
    transform_block_output(s, mp, geo, nt, Tb, b, y);
  });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
