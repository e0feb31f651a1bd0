// cpp/ops/conv2d_cpu/winograd_bf16.cpp -- Winograd F(2x2, 3x3) with bfloat16 products for 3x3
// stride-1 convs (pad <= 2): the bf16 forward, and so the bf16 data gradient (bf16_cpu.cpp runs dx
// as the forward pass of dy with the flipped, transposed kernel).
//
// The output is cut into 2x2 tiles (ceil(P/2) x ceil(Q/2) per image; tiles overhanging the edge
// read zeros and their extra outputs are dropped). With the points 0, 1, -1 and infinity a 4x4
// input tile d and a 3x3 kernel g give the 2x2 output tile
//     Y = A^T [ (G g G^T) (.) (B^T d B) ] A,
//     A^T = | 1 1  1  0 |    B^T = | 1  0 -1  0 |    G = | 1    0    0  |
//           | 0 1 -1 -1 |          | 0  1  1  0 |        | 1/2  1/2 1/2 |
//                                  | 0 -1  1  0 |        | 1/2 -1/2 1/2 |
//                                  | 0  1  0 -1 |        | 0    0    1  |
// Each of the 16 points xi is a product over channels, M[xi] (K, T) = U[xi] (K, C) V[xi] (C, T),
// run as bf16.h's packed product: U[xi] (transformed in double once per call, rounded to float32)
// and V[xi] (transformed in float32) are rounded to bfloat16 as they are packed, C is the
// product's k (pairs of channels, the last one padded with a zero when C is odd), and every sum
// is float32 in vdpbf16ps's order. The output transform runs in float32.
//
// Why F(2x2) and not float32's F(4x4, 3x3) (winograd.cpp): bfloat16's rounding of U and V, not
// float32's, sets the error, and the output transform amplifies it. In a NumPy float64 model at
// ResNet-18's 3x3 layers (tests/ops/winograd_bf16_model.py: U and V rounded to bfloat16, all else
// exact) the normwise error against the exact conv is 2.3-2.4e-3 for direct bf16 (x and w
// rounded), 3.4-4.3e-3 (1.5-1.8x) for F(2x2) and 1.3-2.0e-2 (5.5-8.3x) for F(4x4), forward and
// dx, d2l's and He's init alike. The bound (same file): |y - y_exact| <= ~2u T + O(2^-24) terms,
// u = 2^-8, T = |A^T| (sum_c |U_c| |V_c|) |A|, where direct bf16's is ~2u conv(|x|, |w|); T is
// 1.7-2.7x conv(|x|, |w|) for F(2x2) and 7.5-12.9x for F(4x4) (medians). F(2x2) does 2.25x fewer
// products than direct, F(4x4) 4x.
//
// Same bits on the avx512_bf16, avx512 and avx2 paths and on any thread count: the transforms
// are adds and subtracts alone (every entry of B^T and A^T is 0 or +-1), each rounded on its own,
// in the same order in every lane; the products are bf16.h's; the tiles are cut into chunks of
// whole images whose size depends on the shape alone.
#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "ops/bf16.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

namespace {

constexpr int kPoints = 16;  // 4x4 transformed tile

// G (4x3) in double.
constexpr double kG2[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};

thread_local std::vector<float> tl_u, tl_v, tl_m, tl_rows;
thread_local std::vector<uint32_t> tl_pu, tl_pv;

template <typename T>
T* grow(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// Images per chunk: V and M (16 floats per tile and channel) near 8 MB each at most, a function of
// the shape alone.
int64_t chunk_images(const Conv2dShape& s, int64_t per_image) {
  const int64_t tiles = std::max<int64_t>(32, (int64_t{1} << 17) / std::max(s.C, s.K));
  return std::clamp<int64_t>(tiles / per_image, 1, std::max<int64_t>(s.N, 1));
}

// V[xi] for the tiles of one image plane (H, W) of one channel: tile row i's tc tiles written at
// v + i * tc in point xi's slice, vstep floats after point xi - 1's. Two passes of B^T: along
// the patch rows (contiguous over a padded row of the image), then along its columns.
void input_tiles(const Conv2dShape& s, const float* __restrict plane, int64_t tr, int64_t tc,
                 float* __restrict v, int64_t vstep) {
  const int64_t H = s.H, W = s.W, pad = s.pad, L = 2 * tc + 2;
  float* buf = grow(tl_rows, 8 * L);
  float* rows[4] = {buf, buf + L, buf + 2 * L, buf + 3 * L};
  float* e[4] = {buf + 4 * L, buf + 5 * L, buf + 6 * L, buf + 7 * L};
  for (int64_t i = 0; i < tr; ++i) {
    for (int a = 0; a < 4; ++a) {
      const int64_t h = 2 * i - pad + a;
      float* r = rows[a];
      if (h < 0 || h >= H) {
        std::fill(r, r + L, 0.0f);
        continue;
      }
      const int64_t lo = std::min(pad, L), hi = std::clamp<int64_t>(W + pad, lo, L);
      std::fill(r, r + lo, 0.0f);
      std::copy(plane + h * W + (lo - pad), plane + h * W + (hi - pad), r + lo);
      std::fill(r + hi, r + L, 0.0f);
    }
    for (int64_t q = 0; q < L; ++q) {  // e = B^T d along the rows
      e[0][q] = rows[0][q] - rows[2][q];
      e[1][q] = rows[1][q] + rows[2][q];
      e[2][q] = rows[2][q] - rows[1][q];
      e[3][q] = rows[1][q] - rows[3][q];
    }
    float* out = v + i * tc;
    for (int a = 0; a < 4; ++a) {  // V = e B along the columns
      float* o0 = out + (4 * a + 0) * vstep;
      float* o1 = out + (4 * a + 1) * vstep;
      float* o2 = out + (4 * a + 2) * vstep;
      float* o3 = out + (4 * a + 3) * vstep;
      const float* ea = e[a];
      for (int64_t j = 0; j < tc; ++j) {
        const float d0 = ea[2 * j], d1 = ea[2 * j + 1], d2 = ea[2 * j + 2], d3 = ea[2 * j + 3];
        o0[j] = d0 - d2;
        o1[j] = d1 + d2;
        o2[j] = d2 - d1;
        o3[j] = d1 - d3;
      }
    }
  }
}

// y's plane (P, Q) of one image and output channel from M[xi] (the image's tiles at m, point xi's
// slice mstep floats after xi - 1's): Y = A^T M A + bias, the overhang dropped.
void output_tiles(int64_t P, int64_t Q, int64_t tr, int64_t tc, const float* __restrict m,
                  int64_t mstep, float bias, float* __restrict y) {
  float* buf = grow(tl_rows, 12 * tc);
  float* s[2][4];
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 4; ++b) s[a][b] = buf + (4 * a + b) * tc;
  }
  float* o[2] = {buf + 8 * tc, buf + 10 * tc};
  for (int64_t i = 0; i < tr; ++i) {
    const float* mi = m + i * tc;
    for (int b = 0; b < 4; ++b) {  // s = A^T M along the rows
      const float* m0 = mi + (0 + b) * mstep;
      const float* m1 = mi + (4 + b) * mstep;
      const float* m2 = mi + (8 + b) * mstep;
      const float* m3 = mi + (12 + b) * mstep;
      for (int64_t j = 0; j < tc; ++j) {
        s[0][b][j] = (m0[j] + m1[j]) + m2[j];
        s[1][b][j] = (m1[j] - m2[j]) - m3[j];
      }
    }
    for (int a = 0; a < 2; ++a) {  // Y = s A along the columns, + bias
      for (int64_t j = 0; j < tc; ++j) {
        o[a][2 * j] = ((s[a][0][j] + s[a][1][j]) + s[a][2][j]) + bias;
        o[a][2 * j + 1] = ((s[a][1][j] - s[a][2][j]) - s[a][3][j]) + bias;
      }
    }
    for (int a = 0; a < 2 && 2 * i + a < P; ++a) std::copy(o[a], o[a] + Q, y + (2 * i + a) * Q);
  }
}

}  // namespace

// Only MGPU_CONV_ALGO=winograd takes it: auto and tune run float32 Winograd F(4x4, 3x3) on
// rounded operands at these shapes (bf16.h), and the im2col products measured faster than this
// kernel at every ResNet-18 3x3 layer (bench conv, batch 64, forward 27-36 ms against 43-194 ms,
// backward with dx likewise or worse; AMD EPYC Zen 4, 2 threads, a busy machine): these
// transforms are scalar loops staged through memory, not fused with the products as
// winograd_fused.cpp's are.
bool winograd_bf16_chosen(const Conv2dShape& s, ConvAlgo algo) {
  return algo == ConvAlgo::Winograd && s.R == 3 && s.S == 3 && s.stride == 1 && s.pad <= 2 &&
         s.N > 0;
}

void winograd_bf16_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                           float* y, bool hardware_dot) {
  const int64_t C = s.C, K = s.K, P = s.P(), Q = s.Q(), HW = s.H * s.W, PQ = P * Q;
  const int64_t tr = (P + 1) / 2, tc = (Q + 1) / 2, per_image = tr * tc;
  if (s.N == 0 || K == 0) return;
  // U (16, K, C) = G g G^T in double, rounded to float32, then packed (and rounded to bfloat16)
  // as the products' A operands.
  float* U = grow(tl_u, kPoints * K * C);
  parallel_for(K, [&](int64_t k) {
    for (int64_t c = 0; c < C; ++c) {
      const float* g = w + (k * C + c) * 9;
      double gg[4][3];  // G g
      for (int a = 0; a < 4; ++a) {
        for (int t = 0; t < 3; ++t) {
          gg[a][t] = (kG2[a][0] * g[t] + kG2[a][1] * g[3 + t]) + kG2[a][2] * g[6 + t];
        }
      }
      for (int a = 0; a < 4; ++a) {
        for (int bb = 0; bb < 4; ++bb) {
          U[((a * 4 + bb) * K + k) * C + c] = static_cast<float>(
              (gg[a][0] * kG2[bb][0] + gg[a][1] * kG2[bb][1]) + gg[a][2] * kG2[bb][2]);
        }
      }
    }
  });
  const int64_t aw = bf16_packed_a_words(K, C);
  uint32_t* pu = grow(tl_pu, kPoints * aw);
  for (int xi = 0; xi < kPoints; ++xi) {
    MGPU_CPU_ISA::bf16_pack_a(false, K, C, U + xi * K * C, C, pu + xi * aw);
  }
  const int64_t B = chunk_images(s, per_image), pairs = bf16_pairs(C);
  for (int64_t n0 = 0; n0 < s.N; n0 += B) {
    const int64_t nb = std::min(B, s.N - n0), T = nb * per_image;
    const int64_t bw = bf16_packed_b_words(C, T), panels = (T + kBf16Nr - 1) / kBf16Nr;
    float* vt = grow(tl_v, kPoints * C * T);
    float* mt = grow(tl_m, kPoints * K * T);
    uint32_t* pv = grow(tl_pv, kPoints * bw);
    // V (16, C, T) into vt: tile t = image * per_image + i * tc + j.
    parallel_for(C * nb, [&](int64_t task) {
      const int64_t c = task / nb, i = task % nb;
      input_tiles(s, x + ((n0 + i) * C + c) * HW, tr, tc, vt + c * T + i * per_image, C * T);
    });
    for (int xi = 0; xi < kPoints; ++xi) {
      MGPU_CPU_ISA::bf16_pack_b(false, C, T, vt + xi * C * T, T, pv + xi * bw);
    }
    // M[xi] (K, T) = U[xi] V[xi] into mt, one task per point and panel of kBf16Nr tiles.
    parallel_for(kPoints * panels, [&](int64_t task) {
      const int64_t xi = task / panels, jp = task % panels, j0 = jp * kBf16Nr;
      MGPU_CPU_ISA::bf16_product({K, std::min(kBf16Nr, T - j0), C, pu + xi * aw,
                                  pv + xi * bw + j0 * pairs, mt + xi * K * T + j0, T, false,
                                  hardware_dot});
    });
    parallel_for(K * nb, [&](int64_t task) {
      const int64_t k = task / nb, i = task % nb;
      output_tiles(P, Q, tr, tc, mt + k * T + i * per_image, K * T, b ? b[k] : 0.0f,
                   y + ((n0 + i) * K + k) * PQ);
    });
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
