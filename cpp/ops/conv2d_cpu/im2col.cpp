// cpp/ops/conv2d_cpu/im2col.cpp -- the general conv2d path's unfolding: im2col (and its row
// form) turns a block of images into a matrix so the products are sgemm calls, col2im scatters
// dcol back into dx; plus the rectangle copies they and the pooling planes use.
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

// Rectangles of rows x n floats, source rows sstride apart and destination rows dstride apart:
// im2col copies them, col2im adds them. Up to kFixedWidth floats wide the width is a template
// constant, so a row is a few inlined vector moves; with a runtime width every short row paid
// for loop control and a scalar tail, which made col2im ~2.5x slower on LeNet's 9-float rows.
using RectFn = void (*)(float*, int64_t, const float*, int64_t, int64_t);
constexpr int kFixedWidth = 32;

template <int kN>
void copy_rect_n(float* __restrict d, int64_t dstride, const float* __restrict s, int64_t sstride,
                 int64_t rows) {
  for (int64_t i = 0; i < rows; ++i, d += dstride, s += sstride) {
    for (int j = 0; j < kN; ++j) d[j] = s[j];
  }
}

template <int kN>
void add_rect_n(float* __restrict d, int64_t dstride, const float* __restrict s, int64_t sstride,
                int64_t rows) {
  for (int64_t i = 0; i < rows; ++i, d += dstride, s += sstride) {
    for (int j = 0; j < kN; ++j) d[j] += s[j];
  }
}

template <int... kN>
constexpr std::array<RectFn, sizeof...(kN)> copy_rect_table(std::integer_sequence<int, kN...>) {
  return {{&copy_rect_n<kN>...}};
}
template <int... kN>
constexpr std::array<RectFn, sizeof...(kN)> add_rect_table(std::integer_sequence<int, kN...>) {
  return {{&add_rect_n<kN>...}};
}
constexpr auto kCopyRect = copy_rect_table(std::make_integer_sequence<int, kFixedWidth + 1>{});
constexpr auto kAddRect = add_rect_table(std::make_integer_sequence<int, kFixedWidth + 1>{});

void copy_rect(float* __restrict d, int64_t dstride, const float* __restrict s, int64_t sstride,
               int64_t rows, int64_t n) {
  if (n <= kFixedWidth) {
    kCopyRect[static_cast<size_t>(n)](d, dstride, s, sstride, rows);
    return;
  }
  for (int64_t i = 0; i < rows; ++i, d += dstride, s += sstride) copy_floats(d, s, n);
}

void add_rect(float* __restrict d, int64_t dstride, const float* __restrict s, int64_t sstride,
              int64_t rows, int64_t n) {
  if (n <= kFixedWidth) {
    kAddRect[static_cast<size_t>(n)](d, dstride, s, sstride, rows);
    return;
  }
  for (int64_t i = 0; i < rows; ++i, d += dstride, s += sstride) {
    for (int64_t j = 0; j < n; ++j) d[j] += s[j];
  }
}

// d[q] = s[2q] and d[2q] += s[q] for q < n: stride 2 as a constant, so the compiler vectorizes
// them (even-lane shuffles) instead of moving one float at a time.
inline void gather2(float* __restrict d, const float* __restrict s, int64_t n) {
  for (int64_t q = 0; q < n; ++q) d[q] = s[2 * q];
}
inline void scatter_add2(float* __restrict d, const float* __restrict s, int64_t n) {
  for (int64_t q = 0; q < n; ++q) d[2 * q] += s[q];
}

// Unfolds B images x (B, C, H, W) into col (C*R*S, B*P*Q, rows ld floats apart); image i owns
// columns [i*P*Q, (i+1)*P*Q). Row (c, r, t), column i*P*Q + p*Q + q holds
// x[i, c, p*stride - pad + r, q*stride - pad + t], or 0 in the padding. For each (c, r, t) the
// valid outputs form a rectangle (rows x cols spans), so padding is written as zeros first and
// then the rectangle is copied; a row of col is filled for all B images before the next.
void im2col(const Unfold& u, const float* __restrict x, int64_t B, float* __restrict col,
            int64_t ld) {
  const int64_t C = u.s.C, H = u.s.H, W = u.s.W, R = u.s.R, S = u.s.S;
  const int64_t stride = u.s.stride, pad = u.s.pad, P = u.P, Q = u.Q, CHW = C * H * W;
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t r = 0; r < R; ++r) {
      const Span rows = u.rows[r];
      for (int64_t t = 0; t < S; ++t) {
        const Span cols = u.cols[t];
        float* __restrict row = col + ((c * R + r) * S + t) * ld;
        if (rows.lo > 0 || rows.hi < P || cols.lo > 0 || cols.hi < Q) {
          std::fill(row, row + B * P * Q, 0.0f);
        }
        if (rows.lo == rows.hi || cols.lo == cols.hi) continue;
        const int64_t nrows = rows.hi - rows.lo, n = cols.hi - cols.lo;
        for (int64_t i = 0; i < B; ++i) {
          const float* xs = x + i * CHW + (c * H + rows.lo * stride - pad + r) * W +
                            cols.lo * stride + (t - pad);
          float* ds = row + i * P * Q + rows.lo * Q + cols.lo;
          if (stride == 1) {
            copy_rect(ds, Q, xs, W, nrows, n);
          } else if (stride == 2) {  // a constant stride: the compiler vectorizes the gather
            for (int64_t p = 0; p < nrows; ++p) gather2(ds + p * Q, xs + p * 2 * W, n);
          } else {
            for (int64_t p = 0; p < nrows; ++p) {
              for (int64_t q = 0; q < n; ++q) ds[p * Q + q] = xs[(p * W + q) * stride];
            }
          }
        }
      }
    }
  }
}

// The transpose of im2col: patches (B*P*Q, C*R*S), row i*P*Q + p*Q + q holding that output's
// receptive field in (c, r, t) order. dw = dy * col^T runs ~17% faster from this layout on
// LeNet's conv2 (OpenBLAS multiplies it untransposed instead of gathering strided columns).
// Where a patch lies wholly inside the image (every patch without padding), each (c, r) of it is
// S contiguous floats of x; a 1x1 kernel's patch is one float per channel, H*W floats apart.
// Patches that overhang the padding take the element-wise loop.
void im2col_rows(const Unfold& u, const float* __restrict x, int64_t B, float* __restrict rows) {
  const int64_t C = u.s.C, H = u.s.H, W = u.s.W, R = u.s.R, S = u.s.S;
  const int64_t stride = u.s.stride, pad = u.s.pad, P = u.P, Q = u.Q, CHW = C * H * W;
  const int64_t CRS = C * R * S, HW = H * W;
  for (int64_t i = 0; i < B; ++i) {
    const float* xi = x + i * CHW;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h0 = p * stride - pad;
      const bool rows_inside = h0 >= 0 && h0 + R <= H;
      for (int64_t q = 0; q < Q; ++q) {
        float* __restrict patch = rows + ((i * P + p) * Q + q) * CRS;
        const int64_t v0 = q * stride - pad;
        if (rows_inside && v0 >= 0 && v0 + S <= W) {
          const float* __restrict xs = xi + h0 * W + v0;
          if (R == 1 && S == 1) {
            for (int64_t c = 0; c < C; ++c) patch[c] = xs[c * HW];
            continue;
          }
          for (int64_t c = 0; c < C; ++c) copy_rect(patch + c * R * S, S, xs + c * HW, W, R, S);
          continue;
        }
        for (int64_t c = 0; c < C; ++c) {
          for (int64_t r = 0; r < R; ++r) {
            const int64_t h = p * stride - pad + r;
            for (int64_t t = 0; t < S; ++t) {
              const int64_t v = q * stride - pad + t;
              patch[(c * R + r) * S + t] =
                  h >= 0 && h < H && v >= 0 && v < W ? xi[(c * H + h) * W + v] : 0.0f;
            }
          }
        }
      }
    }
  }
}

// Adds channel c's part of dx (B, C, H, W) for B images from dcol (R*S, B*P*Q, rows ld floats
// apart), the products of that channel's rows of w^T: the scatter-add inverse of im2col, a row
// of dcol at a time for all images in turn. dx's plane of channel c must start zeroed. One thread
// owns the block, and each dx element gets its adds in the fixed (r, t, p, q) order of its
// channel whatever the thread count.
void col2im_channel(const Unfold& u, const float* __restrict dcol, int64_t ld, int64_t B,
                    int64_t c, float* __restrict dx) {
  const Conv2dShape& s = u.s;
  const int64_t Q = u.Q, PQ = u.P * u.Q, CHW = s.C * s.H * s.W;
  for (int64_t r = 0; r < s.R; ++r) {
    const Span rows = u.rows[r];
    for (int64_t t = 0; t < s.S; ++t) {
      const Span cols = u.cols[t];
      const int64_t off = t - s.pad;
      const float* row = dcol + (r * s.S + t) * ld;
      if (rows.lo == rows.hi || cols.lo == cols.hi) continue;
      for (int64_t i = 0; i < B; ++i) {
        const float* src = row + i * PQ;
        float* dxi = dx + i * CHW;
        if (s.stride == 1) {
          add_rect(dxi + (c * s.H + rows.lo - s.pad + r) * s.W + cols.lo + off, s.W,
                   src + rows.lo * Q + cols.lo, Q, rows.hi - rows.lo, cols.hi - cols.lo);
          continue;
        }
        for (int64_t p = rows.lo; p < rows.hi; ++p) {
          float* __restrict dxrow = dxi + (c * s.H + p * s.stride - s.pad + r) * s.W;
          const float* __restrict d = src + p * Q;
          if (s.stride == 2) {
            scatter_add2(dxrow + cols.lo * 2 + off, d + cols.lo, cols.hi - cols.lo);
            continue;
          }
          for (int64_t q = cols.lo; q < cols.hi; ++q) dxrow[q * s.stride + off] += d[q];
        }
      }
    }
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
