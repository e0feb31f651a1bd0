// cpp/ops/conv2d_cpu/winograd.cpp -- Winograd F(4x4, 3x3) for 3x3 stride-1 convolutions (pad 0..2:
// ResNet-18's 3x3 layers): forward, the data gradient (a Winograd convolution of dy with the
// flipped, transposed kernel) and the weight gradient through the transformed domain.
//
// The output is cut into 4x4 tiles (ceil(P/4) x ceil(Q/4) per image; tiles overhanging the edge
// read zeros and their extra outputs are dropped). With the interpolation points 0, 1, -1, 1/2,
// -2 and infinity a 6x6 input tile d and a 3x3 kernel g give the 4x4 output tile
//     Y = A^T [ (G g G^T) (.) (B^T d B) ] A,
//     A^T = | 1 1  1  1    1  0 |    B^T = | 2 -3 -4  3  2  0 |    G: kWinogradG (conv2d_cpu.h)
//           | 0 1 -1  1/2 -2  0 |          | 0 -2  1  5  2  0 |
//           | 0 1  1  1/4  4  0 |          | 0  2 -5  1  2  0 |
//           | 0 1 -1  1/8 -8  1 |          | 0 -2 -1  2  1  0 |
//                                          | 0  1 -2 -1  2  0 |
//                                          | 0  2 -3 -4  3  2 |
// Lavin & Gray's points ("Fast Algorithms for Convolutional Neural Networks", 2015), 0, +-1, +-2
// and infinity, amplify float32 rounding more: inside a ResNet-18 step (4 images of 28x28, d2l's
// and He's initialisation and weights trained 1080 steps), their normwise errors against
// float64 were forward 2.6-6.3x, dx 3.0-11.6x and dw 2.4-7.9x those of the direct (im2col)
// passes; these points give 2.2-4.4x, 2.2-5.5x and 1.7-6.0x, with the same products and a few
// more adds and multiplies in the transforms (no difference in CPU time measured at ResNet-18's
// layers, batch 64, busy machine). Most of the error is the rounding of the products' sums,
// which the output transform amplifies (exact sums halved it, in a NumPy model of these
// kernels); the transforms' own rounding adds ~5%. 0, +-1, +-1/2 or 1/2, 2 were worse, and
// 1/2, -3 or 3/2, -1/2 in between (same model).
// Each of the 36 points xi of the transformed tile is an independent product over channels:
//     M[xi] (K, T) = U[xi] (K, C) * V[xi] (C, T)
// for the T tiles of a block of images. This file holds the weight transform (in double, once per
// call) and the entry points; the forward's transforms and products run block by block in
// winograd_fused.cpp. The weight gradient runs the same products backwards: dU[xi] (K, C) = sum
// over tiles of dM[xi] (K, T) * V[xi]^T with dM = A dY A^T per tile, and dw = G^T dU G
// (winograd_dw.cpp, with db). Both give the same bits on the AVX2 and AVX-512 paths and on any
// number of threads.
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

namespace {

constexpr int kAlpha = 6;   // transformed tile side (4 outputs + 3 - 1)
constexpr int kPoints = kAlpha * kAlpha;
constexpr int kL = 16;      // input channels side by side (lanes) in the weight transform

constexpr auto& kG = kWinogradG;  // G (6x3), conv2d_cpu.h

// U (36, K, C) from w (K, C, 3, 3): U[xi][k][c] = (G g G^T)[xi] of g = w[k, c], or, when
// flip_transpose, of g[r][t] = w[c, k, 2 - r, 2 - t] with w read as (C, K, 3, 3) (the data
// gradient's kernel). In double, kL input channels side by side in lanes, rounded once.
// A k's 36 rows U[xi][k] are built in scratch and then copied out whole: U's rows of one k lie
// K C floats apart (a power of two: 1 MB at 512 channels), so writing the 36 points' 16 floats
// in place, chunk after chunk, would put 36 lines in one L1 and L2 set and miss every time
// (written in place, the transform takes ~25% of the 512-channel layer's forward on 1 thread,
// batch 128; through the scratch rows, about half as long).
void transform_weights(const float* w, int64_t K, int64_t C, bool flip_transpose, float* U) {
  parallel_for(K, [&](int64_t k) {
    float* rows = scratch(tl_row, kPoints * C);
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
          float* dst = rows + (a * kAlpha + b) * C + c0;
          float u[kL];
          for (int l = 0; l < kL; ++l) {
            u[l] = static_cast<float>((gg[a][0][l] * kG[b][0] + gg[a][1][l] * kG[b][1]) +
                                      gg[a][2][l] * kG[b][2]);
          }
          copy_floats(dst, u, n);
        }
      }
    }
    for (int xi = 0; xi < kPoints; ++xi) copy_floats(U + (xi * K + k) * C, rows + xi * C, C);
  });
}

// y = conv(x, w) + b with U the transformed weights (36, K, C): the transforms fused with the
// products, block by block (winograd_fused.cpp).
void forward_with_u(const Conv2dShape& s, const float* x, const float* U, const float* b,
                    float* y, bool round_bf16) {
  winograd_fused_forward(s, x, U, b, y, round_bf16);
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
                      float* y, bool round_bf16) {
  float* U = scratch(tl_transformed, kPoints * s.K * s.C);
  transform_weights(w, s.K, s.C, false, U);
  forward_with_u(s, x, U, b, y, round_bf16);
}

void winograd_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db, bool round_bf16) {
  winograd_dw(s, x, dy, dw, db, round_bf16);
  const int64_t P = s.P(), Q = s.Q(), KC = s.K * s.C;
  // dx: a Winograd convolution of dy (N, K, P, Q) with the flipped, transposed kernel and
  // padding 2 - pad, whose output is (N, C, H, W).
  if (dx) {
    const Conv2dShape t{s.N, s.K, P, Q, s.C, 3, 3, 1, 2 - s.pad};
    float* U = scratch(tl_transformed, kPoints * KC);
    transform_weights(w, s.C, s.K, true, U);
    forward_with_u(t, dy, U, nullptr, dx, round_bf16);
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
