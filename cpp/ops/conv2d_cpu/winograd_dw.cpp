// cpp/ops/conv2d_cpu/winograd_dw.cpp -- the weight and bias gradients of a 3x3 stride-1
// convolution through Winograd F(4x4, 3x3)'s transformed domain (winograd.cpp's backward):
//     dU[xi] (K, C) = sum over tiles t of dM[xi][t][k] * V[xi][t][c],   dw = G^T dU G,
// with V = B^T d B the transformed 6x6 input tiles and dM = A dY A^T the transformed 4x4 dy tiles
// (winograd.cpp's header gives the matrices).
//
// The batch runs in blocks of whole images (about kBlockTiles tiles; a function of the shape
// alone). For each block:
// 1. each (image, 16-channel chunk) of x and of dy is transposed channel-minor (to_lanes: 16
//    channels of a pixel in one vector), framed with zeros, and transformed tile by tile with the
//    16 channels in lanes, into the packed panels V (36, Cp / 16, T, 16) and dM (36, Kp / 16, T,
//    16) (channel counts rounded up to 16, the extra lanes zero): each point's 16-channel chunk
//    is T rows of 16 floats one after another, so a product reads its rows of dM and V as
//    sequential streams, which the hardware prefetchers follow. (Rows of Cp floats, (T, Cp), put
//    a stream's rows 256 bytes or more apart, one line of each 4 KB page used per pass: the AVX2
//    products then run 1.4-1.45x slower, Zen 3, medians of interleaved runs of the products
//    alone at 64 to 256 channels.) The pass over dy also sums each dy plane (db).
// 2. each point xi and block of output columns c (64 on AVX-512, 16 on AVX2) is multiplied out
//    by register-tiled FMA kernels: up to 6 rows k (6, 6 and 4 per 16-channel chunk of dM) x 64
//    (or 16) columns c of accumulators, each tile t a row of V loaded and the rows' values of dM
//    broadcast. A kernel sums the block's tiles in runs of kRunTiles: each run is a chain of
//    FMAs from 0 in tile order, the runs are added in order into a partial sum of the block, and
//    that is added to dU (the first block stores).
// So every dU entry is the same sum over a block's tiles, then the blocks added in order,
// whichever thread runs which job and whatever the register tile: the AVX2 and AVX-512 paths and
// every thread count give the same bits. The runs are what keeps dw within a few times the
// direct sum's error: one chain of FMAs over the block's 256 tiles gave dw about 10x the error
// of im2col's sgemm against float64 (ResNet-18's 28x28 layers inside a real step at d2l's
// initialisation, normwise 3.1e-6 against 3.3e-7); in runs of 32 about half of that. The
// products' error, not the transforms' (whose rounding adds ~5% to it), is what the runs cut. (Explicit FMA intrinsics: this file
// is compiled with -ffp-contract=off so that the transforms' adds and multiplies round one by
// one, alike on both paths.)
// dw = G^T dU G runs in double per (k, c); db adds the per-plane sums in image order.
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
constexpr int kLanes = 16;  // channels per transform chunk (one F16)
// Tiles per block: each dU entry takes this many FMAs per load and store of dU. The panels
// (36 x tiles x (Cp + Kp) floats) are 4.5 MB at ResNet-18's 64 channels but 38 MB at 512, so
// they live in L3 or memory; what stays in L2 is one point's slice (tiles x (Cp + Kp), at most
// 1 MB), which the products of that point read Cp / 64 times.
constexpr int64_t kBlockTiles = 256;
// Tiles per run of FMAs inside a block (see the header): each dU entry of a block is the sum, in
// order, of runs of this many products, each a chain from 0. Shorter runs round less along the
// chain but add more partial sums; 16 and 32 gave the same error (1.2e-6 and 1.3e-6 at the
// 28x28 layer above, NumPy model of this summation), and at 32 the partial sums' loads and
// stores (L1) cost ~1/32 of the FMAs.
constexpr int64_t kRunTiles = 32;

constexpr auto& kG = kWinogradG;  // G (6x3), conv2d_cpu.h

// Scratch: the calling thread holds the panels, dU (in tl_transformed, conv2d_cpu.h) and the
// plane sums; each worker its frames.
inline thread_local std::vector<float> tl_panels, tl_sums, tl_frame;

// 16-float loads and stores by reference: on the AVX2 path an F16 passed or returned by value
// would change the calling convention (GCC's -Wpsabi); inlined, these are plain moves.
inline void ld16(F16& v, const float* p) { v = *reinterpret_cast<const Unaligned<F16>::type*>(p); }
inline void st16(float* p, const F16& v) { *reinterpret_cast<Unaligned<F16>::type*>(p) = v; }

// r = B^T d along one axis, six vectors of 16 channels (winograd_fused.cpp's formulas).
inline void input_1d(const F16* d, F16* r) {
  const F16 d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3], d4 = d[4], d5 = d[5];
  const F16 p = d3 - d1, q = d4 - d2;
  r[0] = (2.0f * (d0 + d4) + 3.0f * p) - 4.0f * d2;
  r[1] = (2.0f * (d4 - d1) + d2) + 5.0f * d3;
  r[2] = (2.0f * (d4 + d1) + d3) - 5.0f * d2;
  r[3] = 2.0f * p + q;
  r[4] = 2.0f * q - p;
  r[5] = (2.0f * (d1 + d5) + 3.0f * q) - 4.0f * d3;
}

// e = A g along one axis (4 -> 6), the transpose of the forward's output transform.
inline void grad_1d(const F16* g, F16* e) {
  const F16 g0 = g[0], g1 = g[1], g2 = g[2], g3 = g[3];
  const F16 s02 = g0 + g2, s13 = g1 + g3;
  e[0] = g0;
  e[1] = s02 + s13;
  e[2] = s02 - s13;
  e[3] = (g0 + 0.25f * g2) + 0.5f * (g1 + 0.25f * g3);
  e[4] = (g0 + 4.0f * g2) - 2.0f * (g1 + 4.0f * g3);
  e[5] = g3;
}

// The tile grid of an image.
struct Grid {
  int64_t rows, cols, per_image;
  explicit Grid(const Conv2dShape& s)
      : rows((s.P() + kTile - 1) / kTile), cols((s.Q() + kTile - 1) / kTile),
        per_image(rows * cols) {}
};

// Copies plane (rows, cols) of 16-lane pixels (channel-minor, from to_lanes) into a zero frame
// (frows, fcols) at offset (off, off); the plane's pixels past the frame are dropped.
void frame_plane(const float* __restrict plane, int64_t rows, int64_t cols, int64_t off,
                 int64_t frows, int64_t fcols, float* __restrict frame) {
  const F16 zero = {};
  const int64_t r1 = std::min(rows, frows - off), c1 = std::min(cols, fcols - off);
  for (int64_t fr = 0; fr < frows; ++fr) {
    float* dst = frame + fr * fcols * kLanes;
    const int64_t r = fr - off;
    int64_t fc = 0;
    if (r >= 0 && r < r1) {
      for (; fc < off; ++fc) st16(dst + fc * kLanes, zero);
      copy_floats(dst + off * kLanes, plane + r * cols * kLanes, c1 * kLanes);
      fc = off + c1;
    }
    for (; fc < fcols; ++fc) st16(dst + fc * kLanes, zero);
  }
}

// Where row t of point xi's chunk c / 16 (c a multiple of 16) starts in a block's panel
// (36, Cp / 16, T, 16): V's, or dM's with Kp for Cp.
inline int64_t panel_offset(int64_t xi, int64_t c, int64_t t, int64_t T, int64_t Cp) {
  return (xi * Cp + c) * T + t * kLanes;
}

// V[xi][c0 / 16][t0 + j][0 .. 16) for the tiles j of one image's 16 channels c0.. of x, in the
// block's panel v (36, Cp / 16, T, 16).
void transform_input(const Conv2dShape& s, const Grid& g, const float* x, int64_t c0,
                     float* __restrict v, int64_t t0, int64_t T, int64_t Cp, bool round_bf16) {
  const int64_t HW = s.H * s.W, Hp = kTile * g.rows + 2, Wp = kTile * g.cols + 2;
  float* xT = scratch(tl_frame, (HW + Hp * Wp) * kLanes);
  float* frame = xT + HW * kLanes;
  to_lanes(x + c0 * HW, HW, std::min<int64_t>(kLanes, s.C - c0), HW, xT);
  if (round_bf16) bf16::round_vectors(xT, HW * kLanes / 16);
  frame_plane(xT, s.H, s.W, s.pad, Hp, Wp, frame);
  for (int64_t j = 0; j < g.per_image; ++j) {
    const float* src = frame + ((j / g.cols) * kTile * Wp + (j % g.cols) * kTile) * kLanes;
    F16 t[kAlpha][kAlpha];  // t[a][b] = (B^T d)[a][b]
    for (int b = 0; b < kAlpha; ++b) {
      F16 col[kAlpha], r[kAlpha];
      for (int a = 0; a < kAlpha; ++a) ld16(col[a], src + (a * Wp + b) * kLanes);
      input_1d(col, r);
      for (int a = 0; a < kAlpha; ++a) t[a][b] = r[a];
    }
    for (int a = 0; a < kAlpha; ++a) {
      F16 r[kAlpha];
      input_1d(t[a], r);
      for (int b = 0; b < kAlpha; ++b) {
        st16(v + panel_offset(a * kAlpha + b, c0, t0 + j, T, Cp), r[b]);
      }
    }
  }
}

// dM[xi][k0 / 16][t0 + j][0 .. 16) for the tiles j of one image's 16 dy channels k0.., in the
// block's panel dm (36, Kp / 16, T, 16), and the sum of each of those dy planes (pixels in order)
// into sums[k0 ..).
void transform_grad(const Conv2dShape& s, const Grid& g, const float* dy, int64_t k0,
                    float* __restrict dm, int64_t t0, int64_t T, int64_t Kp,
                    float* __restrict sums, bool round_bf16) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, Pp = kTile * g.rows, Qp = kTile * g.cols;
  float* dyT = scratch(tl_frame, (PQ + Pp * Qp) * kLanes);
  float* frame = dyT + PQ * kLanes;
  to_lanes(dy + k0 * PQ, PQ, std::min<int64_t>(kLanes, s.K - k0), PQ, dyT);
  if (round_bf16) bf16::round_vectors(dyT, PQ * kLanes / 16);
  F16 sum = {};
  for (int64_t j = 0; j < PQ; ++j) {
    F16 p;
    ld16(p, dyT + j * kLanes);
    sum += p;
  }
  st16(sums + k0, sum);
  frame_plane(dyT, P, Q, 0, Pp, Qp, frame);
  for (int64_t j = 0; j < g.per_image; ++j) {
    const float* src = frame + ((j / g.cols) * kTile * Qp + (j % g.cols) * kTile) * kLanes;
    F16 t[kAlpha][kTile];  // t[a][b] = (A g)[a][b]
    for (int b = 0; b < kTile; ++b) {
      F16 col[kTile], e[kAlpha];
      for (int a = 0; a < kTile; ++a) ld16(col[a], src + (a * Qp + b) * kLanes);
      grad_1d(col, e);
      for (int a = 0; a < kAlpha; ++a) t[a][b] = e[a];
    }
    for (int a = 0; a < kAlpha; ++a) {
      F16 e[kAlpha];
      grad_1d(t[a], e);
      for (int b = 0; b < kAlpha; ++b) {
        st16(dm + panel_offset(a * kAlpha + b, k0, t0 + j, T, Kp), e[b]);
      }
    }
  }
}

// ---- The register-tiled products ----
#if defined(__AVX512F__)
using R = __m512;
inline R rzero() { return _mm512_setzero_ps(); }
inline R rload(const float* p) { return _mm512_loadu_ps(p); }
inline void rstore(float* p, R v) { _mm512_storeu_ps(p, v); }
inline R rbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline R rfma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline R radd(R a, R b) { return _mm512_add_ps(a, b); }
constexpr int kNV = 4;  // vectors per row of the register tile: 64 columns
#else
using R = __m256;
inline R rzero() { return _mm256_setzero_ps(); }
inline R rload(const float* p) { return _mm256_loadu_ps(p); }
inline void rstore(float* p, R v) { _mm256_storeu_ps(p, v); }
inline R rbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline R rfma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
inline R radd(R a, R b) { return _mm256_add_ps(a, b); }
constexpr int kNV = 2;  // 16 columns: 12 accumulators, 2 loads and a broadcast in 16 registers
#endif
constexpr int kMR = 6;           // rows k of the register tile
constexpr int kNC = kNV * kW;    // columns c of a full register tile

// du (MR, NV * kW; rows ldc apart) = (add ? du : 0) + sum over t < T of a[t][i] * b[t][j],
// a and b in panel chunks (T, 16): a's rows i < MR <= 16 in one chunk, b's columns j in
// NV * kW / 16 chunks chunk_step floats apart. The sum per entry: runs of kRunTiles tiles, each a
// chain of FMAs from 0 in t order, added in order into part (on the stack: the accumulators
// take the registers), then part into du.
template <int MR, int NV>
void product(const float* __restrict a, const float* __restrict b, int64_t chunk_step, int64_t T,
             float* __restrict du, int64_t ldc, bool add) {
  alignas(64) float part[MR][NV * kW] = {};
  for (int64_t t0 = 0; t0 < T; t0 += kRunTiles) {
    const int64_t t1 = std::min(T, t0 + kRunTiles);
    R acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = rzero();
    }
    for (int64_t t = t0; t < t1; ++t) {
      R bv[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        bv[j] = rload(b + (j * kW / kLanes) * chunk_step + t * kLanes + j * kW % kLanes);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const R av = rbroadcast(a + t * kLanes + i);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[i][j] = rfma(av, bv[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        float* p = part[i] + j * kW;
        rstore(p, t0 == 0 ? acc[i][j] : radd(rload(p), acc[i][j]));
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      float* p = du + i * ldc + j * kW;
      const R v = rload(part[i] + j * kW);
      rstore(p, add ? radd(rload(p), v) : v);
    }
  }
}

using ProductFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool);
constexpr auto kProducts = table_1_to<kMR, kNV>([](auto mr, auto nv) -> ProductFn {
  return &product<decltype(mr)::value, decltype(nv)::value>;
});

}  // namespace

void winograd_dw(const Conv2dShape& s, const float* x, const float* dy, float* dw, float* db,
                 bool round_bf16) {
  const Grid g(s);
  const int64_t PQ = s.P() * s.Q(), HW = s.H * s.W;
  const int64_t Cp = (s.C + kLanes - 1) / kLanes * kLanes, Kp = (s.K + kLanes - 1) / kLanes * kLanes;
  const int64_t Cc = Cp / kLanes, Kc = Kp / kLanes, col_blocks = (Cp + kNC - 1) / kNC;
  if (s.N == 0) {
    std::fill(dw, dw + s.K * s.C * 9, 0.0f);
    if (db) std::fill(db, db + s.K, 0.0f);
    return;
  }
  const int64_t per_block = std::max<int64_t>(1, kBlockTiles / g.per_image);
  const int64_t T_max = std::min(per_block, s.N) * g.per_image;
  float* v = scratch(tl_panels, kPoints * T_max * (Cp + Kp));
  float* dm = v + kPoints * T_max * Cp;
  float* du = scratch(tl_transformed, kPoints * s.K * Cp);
  float* sums = scratch(tl_sums, s.N * Kp);
  for (int64_t n0 = 0; n0 < s.N; n0 += per_block) {
    const int64_t B = std::min(per_block, s.N - n0), T = B * g.per_image;
    parallel_for(B * (Cc + Kc), [&](int64_t job) {
      const int64_t i = job / (Cc + Kc), chunk = job % (Cc + Kc), n = n0 + i;
      if (chunk < Cc) {
        transform_input(s, g, x + n * s.C * HW, chunk * kLanes, v, i * g.per_image, T, Cp,
                        round_bf16);
      } else {
        transform_grad(s, g, dy + n * s.K * PQ, (chunk - Cc) * kLanes,
                       dm, i * g.per_image, T, Kp, sums + n * Kp, round_bf16);
      }
    });
    const bool add = n0 > 0;
    parallel_for(kPoints * col_blocks, [&](int64_t job) {
      const int64_t xi = job / col_blocks, c0 = (job % col_blocks) * kNC;
      const int nv = static_cast<int>(std::min<int64_t>(kNC, Cp - c0) / kW);
      const float* b = v + panel_offset(xi, c0, 0, T, Cp);
      float* out = du + xi * s.K * Cp + c0;
      for (int64_t kc = 0; kc < s.K; kc += kLanes) {  // k tiles inside each chunk of dM
        const int64_t kc_end = std::min(s.K, kc + kLanes);
        for (int64_t k0 = kc; k0 < kc_end; k0 += kMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMR, kc_end - k0));
          const float* a = dm + panel_offset(xi, kc, 0, T, Kp) + (k0 - kc);
          kProducts[mr - 1][nv - 1](a, b, T * kLanes, T, out + k0 * Cp, Cp, add);
        }
      }
    });
  }
  // dw[k][c] = G^T dU[k][c] G, in double, 16 input channels side by side, from a copy of the
  // 36 points' rows of dU for this k: in place they lie K Cp floats apart (1 MB at 512
  // channels, a power of two), so the 36 lines each 16 channels read would share one L1 and L2
  // set and miss every time (read in place, the 512-channel layer's final transform takes as
  // long as its products on 1 thread, batch 128; from the copy, less than half as long).
  parallel_for(s.K, [&](int64_t k) {
    float* rows = scratch(tl_row, kPoints * Cp);
    for (int xi = 0; xi < kPoints; ++xi) {
      copy_floats(rows + xi * Cp, du + (xi * s.K + k) * Cp, Cp);
    }
    for (int64_t c0 = 0; c0 < s.C; c0 += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, s.C - c0);
      double t[3][kAlpha][kLanes] = {};  // G^T dU
      for (int a = 0; a < kAlpha; ++a) {
        for (int b = 0; b < kAlpha; ++b) {
          const float* src = rows + (a * kAlpha + b) * Cp + c0;
          for (int r = 0; r < 3; ++r) {
            for (int l = 0; l < kLanes; ++l) t[r][b][l] += kG[a][r] * static_cast<double>(src[l]);
          }
        }
      }
      for (int r = 0; r < 3; ++r) {
        for (int q = 0; q < 3; ++q) {
          double acc[kLanes] = {};
          for (int b = 0; b < kAlpha; ++b) {
            for (int l = 0; l < kLanes; ++l) acc[l] += t[r][b][l] * kG[b][q];
          }
          for (int64_t l = 0; l < n; ++l) {
            dw[((k * s.C + c0 + l) * 3 + r) * 3 + q] = static_cast<float>(acc[l]);
          }
        }
      }
    }
  });
  // db: the plane sums added in image order.
  if (db) {
    for (int64_t k = 0; k < s.K; ++k) {
      float acc = 0.0f;
      for (int64_t n = 0; n < s.N; ++n) acc += sums[n * Kp + k];
      db[k] = acc;
    }
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
