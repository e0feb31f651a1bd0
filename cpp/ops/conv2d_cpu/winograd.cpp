// cpp/ops/conv2d_cpu/winograd.cpp -- Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions (pad 0..2:
// ResNet-18's 3x3 layers): forward, the data gradient (a Winograd convolution of dy with the
// flipped, transposed kernel) and the weight gradient through the transformed domain.
//
// The output is cut into 4x4 tiles (ceil(P/4) x ceil(Q/4) per image; tiles overhanging the edge
// read zeros and their extra outputs are dropped). With the interpolation points 0, 1, -1, 2, -2
// and infinity (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2015) a 6x6
// input tile d and a 3x3 kernel g give the 4x4 output tile
//     Y = A^T [ (G g G^T) (.) (B^T d B) ] A,
// so each of the 36 points xi of the transformed tile is an independent product over channels:
//     M[xi] (K, T) = U[xi] (K, C) * V[xi] (C, T)
// for the T tiles of a block of images, one sgemm per point. The weight gradient runs the same
// products backwards: dU[xi] (K, C) = sum over tiles of dM[xi] (K, T) * V[xi]^T with
// dM = A dY A^T per tile, and dw = G^T dU G (winograd_dw.cpp, with db).
//
// The transforms run 16 tiles of one image plane side by side (loops over 16 lanes that the
// compiler vectorises on both paths, the same operations in every lane), so the AVX2 and AVX-512
// paths give the same bits. The weight transforms (cheap: once per call) run in double.
// Determinism: blocks are a function of the shape alone (each point's sgemm on one thread), so no
// result depends on the thread count.
#include <cmath>

#include "core/parallel.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"
#include "ops/gemm.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

namespace {

constexpr int kTile = 4;    // outputs per tile side
constexpr int kAlpha = 6;   // transformed tile side (kTile + 3 - 1)
constexpr int kPoints = kAlpha * kAlpha;
constexpr int kL = 16;      // tiles per transform chunk (lanes)

// G (6x3): the kernel transform, in double (applied once per call).
constexpr double kG[kAlpha][3] = {
    {1.0 / 4, 0, 0},
    {-1.0 / 6, -1.0 / 6, -1.0 / 6},
    {-1.0 / 6, 1.0 / 6, -1.0 / 6},
    {1.0 / 24, 1.0 / 12, 1.0 / 6},
    {1.0 / 24, -1.0 / 12, 1.0 / 6},
    {0, 0, 1}};

using Lane = float[kL];

// r = B^T d for six lane rows d[0..5] (each kL tiles): the input transform along one axis.
inline void input_1d(const float (*d)[kL], float (*r)[kL]) {
  for (int l = 0; l < kL; ++l) {
    const float d0 = d[0][l], d1 = d[1][l], d2 = d[2][l], d3 = d[3][l], d4 = d[4][l],
                d5 = d[5][l];
    r[0][l] = (4.0f * d0 - 5.0f * d2) + d4;
    r[1][l] = (d3 + d4) - 4.0f * (d1 + d2);
    r[2][l] = (d4 - d3) + 4.0f * (d1 - d2);
    r[3][l] = (d4 - d2) + 2.0f * (d3 - d1);
    r[4][l] = (d4 - d2) - 2.0f * (d3 - d1);
    r[5][l] = (4.0f * d1 - 5.0f * d3) + d5;
  }
}

// o = A^T m for six lane rows m[0..5]: the output transform along one axis (6 -> 4).
inline void output_1d(const float (*m)[kL], float (*o)[kL]) {
  for (int l = 0; l < kL; ++l) {
    const float m0 = m[0][l], m1 = m[1][l], m2 = m[2][l], m3 = m[3][l], m4 = m[4][l],
                m5 = m[5][l];
    const float s12 = m1 + m2, d12 = m1 - m2, s34 = m3 + m4, d34 = m3 - m4;
    o[0][l] = (m0 + s12) + s34;
    o[1][l] = d12 + 2.0f * d34;
    o[2][l] = s12 + 4.0f * s34;
    o[3][l] = (d12 + 8.0f * d34) + m5;
  }
}

// The block layout: T tiles (images of the block one after another, tiles row-major in each),
// and the tile grid of an image.
struct Tiles {
  int64_t rows, cols, per_image;
  explicit Tiles(const Conv2dShape& s)
      : rows((s.P() + kTile - 1) / kTile), cols((s.Q() + kTile - 1) / kTile),
        per_image(rows * cols) {}
};

// Per-thread buffers: the calling thread's transformed weights, inputs and products; each
// worker's zero-padded image plane. Grown once to the largest shape, then reused.
inline thread_local std::vector<float> tl_u, tl_v, tl_m, tl_plane;

// Images per block: enough tiles for sgemm to run near its peak, while each transformed buffer
// (36 planes of max(C, K) x T floats) stays near 8 MB. A function of the shape alone.
int64_t block_images(const Conv2dShape& s, const Tiles& t) {
  const int64_t ch = std::max<int64_t>(1, std::max(s.C, s.K));
  const int64_t want = std::clamp<int64_t>((int64_t{1} << 21) / (kPoints * ch), 64, 1024);
  return std::max<int64_t>(1, want / t.per_image);
}

// U (36, K, C) from w (K, C, 3, 3): U[xi][k][c] = (G g G^T)[xi] of g = w[k, c], or, when
// flip_transpose, of g[r][t] = w[c, k, 2 - r, 2 - t] with w read as (C, K, 3, 3) (the data
// gradient's kernel). In double, kL input channels side by side in lanes, rounded once.
void transform_weights(const float* w, int64_t K, int64_t C, bool flip_transpose, float* U) {
  parallel_for(K, [&](int64_t k) {
    for (int64_t c0 = 0; c0 < C; c0 += kL) {
      const int64_t n = std::min<int64_t>(kL, C - c0);
      double g[3][3][kL];
      for (int64_t l = 0; l < kL; ++l) {
        const int64_t c = c0 + std::min(l, n - 1);
        for (int r = 0; r < 3; ++r) {
          for (int t = 0; t < 3; ++t) {
            g[r][t][l] = flip_transpose ? w[((c * K + k) * 3 + (2 - r)) * 3 + (2 - t)]
                                        : w[((k * C + c) * 3 + r) * 3 + t];
          }
        }
      }
      double gg[kAlpha][3][kL];  // G g
      for (int a = 0; a < kAlpha; ++a) {
        for (int t = 0; t < 3; ++t) {
          for (int l = 0; l < kL; ++l) {
            gg[a][t][l] = (kG[a][0] * g[0][t][l] + kG[a][1] * g[1][t][l]) + kG[a][2] * g[2][t][l];
          }
        }
      }
      for (int a = 0; a < kAlpha; ++a) {
        for (int b = 0; b < kAlpha; ++b) {
          float* dst = U + ((a * kAlpha + b) * K + k) * C + c0;
          float u[kL];
          for (int l = 0; l < kL; ++l) {
            u[l] = static_cast<float>((gg[a][0][l] * kG[b][0] + gg[a][1][l] * kG[b][1]) +
                                      gg[a][2][l] * kG[b][2]);
          }
          for (int64_t l = 0; l < n; ++l) dst[l] = u[l];
        }
      }
    }
  });
}

// V[xi][c][t0 + j] for the tiles of one plane (H, W) of channel c: the plane is copied into a
// zero-padded (4 rows + 2, 4 cols + 2) frame at offset pad, then each chunk of kL tiles is
// gathered, transformed along rows and columns in lanes, and stored to the 36 point planes
// (rows ld = T floats apart, planes plane_stride floats apart).
void transform_input_plane(const float* __restrict x, int64_t H, int64_t W, int64_t pad,
                           const Tiles& tl, float* __restrict v, int64_t plane_stride) {
  const int64_t Hp = kTile * tl.rows + 2, Wp = kTile * tl.cols + 2;
  float* __restrict frame = scratch(tl_plane, Hp * Wp);
  std::fill(frame, frame + Hp * Wp, 0.0f);
  const int64_t h1 = std::min(H, Hp - pad), w1 = std::min(W, Wp - pad);
  for (int64_t h = 0; h < h1; ++h) copy_floats(frame + (h + pad) * Wp + pad, x + h * W, w1);
  for (int64_t j0 = 0; j0 < tl.per_image; j0 += kL) {
    const int64_t n = std::min<int64_t>(kL, tl.per_image - j0);
    alignas(64) float d[kAlpha][kAlpha][kL];  // d[a][b][lane]
    for (int64_t l = 0; l < kL; ++l) {
      const int64_t j = j0 + std::min(l, n - 1);  // lanes past the end repeat the last tile
      const float* src = frame + (j / tl.cols) * kTile * Wp + (j % tl.cols) * kTile;
      for (int a = 0; a < kAlpha; ++a) {
        for (int b = 0; b < kAlpha; ++b) d[a][b][l] = src[a * Wp + b];
      }
    }
    alignas(64) float col[kAlpha][kL], rt[kAlpha][kL], t[kAlpha][kAlpha][kL];
    for (int b = 0; b < kAlpha; ++b) {  // along the rows: t[.][b] = B^T d[.][b]
      for (int a = 0; a < kAlpha; ++a) {
        for (int l = 0; l < kL; ++l) col[a][l] = d[a][b][l];
      }
      input_1d(col, rt);
      for (int a = 0; a < kAlpha; ++a) {
        for (int l = 0; l < kL; ++l) t[a][b][l] = rt[a][l];
      }
    }
    for (int a = 0; a < kAlpha; ++a) {  // along the columns: out[a][.] = B^T t[a][.]
      input_1d(t[a], rt);
      for (int b = 0; b < kAlpha; ++b) {
        float* dst = v + (a * kAlpha + b) * plane_stride + j0;
        for (int64_t l = 0; l < n; ++l) dst[l] = rt[b][l];
      }
    }
  }
}

// y plane (P, Q) of channel k = A^T M A + bias for the tiles of one image, M[xi] read from the
// point planes (rows plane_stride floats apart); outputs past the plane's edge are dropped.
void transform_output_plane(const float* __restrict m, int64_t plane_stride, const Tiles& tl,
                            float bias, int64_t P, int64_t Q, float* __restrict y) {
  for (int64_t j0 = 0; j0 < tl.per_image; j0 += kL) {
    const int64_t n = std::min<int64_t>(kL, tl.per_image - j0);
    alignas(64) float mm[kAlpha][kAlpha][kL];
    for (int a = 0; a < kAlpha; ++a) {
      for (int b = 0; b < kAlpha; ++b) {
        const float* src = m + (a * kAlpha + b) * plane_stride + j0;
        for (int64_t l = 0; l < kL; ++l) mm[a][b][l] = src[std::min(l, n - 1)];
      }
    }
    alignas(64) float s[kAlpha][kTile][kL], o[kTile][kL], col[kAlpha][kL];
    for (int a = 0; a < kAlpha; ++a) output_1d(mm[a], s[a]);  // along the columns
    alignas(64) float out[kTile][kTile][kL];
    for (int b = 0; b < kTile; ++b) {  // along the rows
      for (int a = 0; a < kAlpha; ++a) {
        for (int l = 0; l < kL; ++l) col[a][l] = s[a][b][l];
      }
      output_1d(col, o);
      for (int a = 0; a < kTile; ++a) {
        for (int l = 0; l < kL; ++l) out[a][b][l] = o[a][l] + bias;
      }
    }
    for (int64_t l = 0; l < n; ++l) {
      const int64_t j = j0 + l, p0 = (j / tl.cols) * kTile, q0 = (j % tl.cols) * kTile;
      const int64_t pr = std::min<int64_t>(kTile, P - p0), qr = std::min<int64_t>(kTile, Q - q0);
      for (int64_t a = 0; a < pr; ++a) {
        for (int64_t b = 0; b < qr; ++b) y[(p0 + a) * Q + q0 + b] = out[a][b][l];
      }
    }
  }
}

// y = conv(x, w) + b with U the transformed weights (36, K, C): the transforms fused with the
// products, block by block (winograd_fused.cpp).
void forward_with_u(const Conv2dShape& s, const float* x, const float* U, const float* b,
                    float* y) {
  winograd_fused_forward(s, x, U, b, y);
}

// The forward before winograd_fused.cpp: whole-block panels V and M through memory and one sgemm
// per point. Unused; kept until the merge with the weight gradient's rewrite removes it.
[[maybe_unused]] void forward_with_u_sgemm(const Conv2dShape& s, const float* x, const float* U,
                                           const float* b, float* y) {
  const Tiles tl(s);
  const int64_t P = s.P(), Q = s.Q(), HW = s.H * s.W, PQ = P * Q;
  const int64_t per_block = block_images(s, tl);
  const int64_t T_max = std::min(per_block, s.N) * tl.per_image;
  float* v = scratch(tl_v, kPoints * s.C * T_max);
  float* m = scratch(tl_m, kPoints * s.K * T_max);
  for (int64_t n0 = 0; n0 < s.N; n0 += per_block) {
    const int64_t B = std::min(per_block, s.N - n0), T = B * tl.per_image;
    parallel_for(B * s.C, [&](int64_t ic) {
      const int64_t i = ic / s.C, c = ic % s.C;
      transform_input_plane(x + ((n0 + i) * s.C + c) * HW, s.H, s.W, s.pad, tl,
                            v + c * T + i * tl.per_image, s.C * T);
    });
    parallel_for(kPoints, [&](int64_t xi) {
      sgemm(false, false, s.K, T, s.C, 1.0f, U + xi * s.K * s.C, s.C, v + xi * s.C * T, T, 0.0f,
            m + xi * s.K * T, T);
    });
    parallel_for(B * s.K, [&](int64_t ik) {
      const int64_t i = ik / s.K, k = ik % s.K;
      transform_output_plane(m + k * T + i * tl.per_image, s.K * T, tl, b ? b[k] : 0.0f, P, Q,
                             y + ((n0 + i) * s.K + k) * PQ);
    });
  }
}

}  // namespace

// The fused forward (winograd_fused.cpp) gathers 16 tiles by int32 offsets that span up to 16
// images of x (forward) or of dy (the data gradient): each must stay below 2^30 floats.
bool winograd_fits(const Conv2dShape& s) {
  constexpr int64_t kGatherSpan = int64_t{1} << 30;
  return s.R == 3 && s.S == 3 && s.stride == 1 && s.pad <= 2 &&
         16 * s.C * s.H * s.W < kGatherSpan && 16 * s.K * s.P() * s.Q() < kGatherSpan;
}

void winograd_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                      float* y) {
  float* U = scratch(tl_u, kPoints * s.K * s.C);
  transform_weights(w, s.K, s.C, false, U);
  forward_with_u(s, x, U, b, y);
}

void winograd_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db) {
  winograd_dw(s, x, dy, dw, db);
  const int64_t P = s.P(), Q = s.Q(), KC = s.K * s.C;
  // dx: a Winograd convolution of dy (N, K, P, Q) with the flipped, transposed kernel and
  // padding 2 - pad, whose output is (N, C, H, W).
  if (dx) {
    const Conv2dShape t{s.N, s.K, P, Q, s.C, 3, 3, 1, 2 - s.pad};
    float* U = scratch(tl_u, kPoints * KC);
    transform_weights(w, s.C, s.K, true, U);
    forward_with_u(t, dy, U, nullptr, dx);
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
