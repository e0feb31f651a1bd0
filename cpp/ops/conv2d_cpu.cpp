// cpp/ops/conv2d_cpu.cpp -- conv2d forward and backward on the CPU (LeNet's two convolutions).
// x (N, C, H, W), w (K, C, R, S) seen as a (K, C*R*S) matrix, b (K), y and dy (N, K, P, Q).
// Three ways, chosen by the shape alone (so every thread count computes the same bits):
// - few taps (C*R*S <= 16, stride 1, no padding, Q >= 16: LeNet's conv1): direct loops over the
//   taps, sixteen output columns at a time (im2col and a packed sgemm would cost more than the
//   arithmetic);
// - other convolutions with stride 1 and no padding (LeNet's conv2): blocks of 16 images side by
//   side in vector lanes, multiplied out by register-tiled FMA kernels (no im2col, no packing);
// - the rest (padding, strides): a block of B images is unfolded (im2col) into col (C*R*S,
//   B*P*Q), so y = w * col, dw = dy * col^T and dcol = w^T * dy are sgemm calls and
//   dx = col2im(dcol).
// conv2d_relu_pool_* (LeNet's conv + relu + avg-pool blocks) share the block loops and apply
// relu and the pooling to each block's product, or build its dy, while it is in cache.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "ops/gemm.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"

namespace mgpu::ops::cpu {

namespace {

// Images per block (im2col and direct paths; the lane path uses kLaneBlock = 16): the unit of
// parallel work, and the unit of the batch sums in dw and db. Each block sums its images into its
// own slot and the slots are added in block order afterwards. The size is a constant, never
// derived from the thread count, so every thread count adds the same numbers in the same order
// and gives bitwise-equal results (shards that are multiples of it also keep their blocks when a
// batch is split across devices). 8 images make an im2col product 8 images wide, where OpenBLAS
// ran ~20% faster than one image at a time.
constexpr int64_t kBlock = 8;

// The shortest patch (C*R*S floats) for which backward builds dw from im2col_rows (see there).
constexpr int64_t kPatchRowsMin = 64;

// Elements per task when adding the dw slots together; any size gives the same result.
constexpr int64_t kReduceChunk = 4096;

// Per-thread scratch, grown once to the largest shape seen and then reused, so steady-state
// training never allocates here. Workers use col, mat, row and lanes; the calling thread holds the
// slots, the lane path's transposed weights and its tap offsets.
thread_local std::vector<float> tl_col, tl_mat, tl_row, tl_slots, tl_lanes, tl_weights;
thread_local std::vector<int64_t> tl_offsets;

float* scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// The outputs o in [lo, hi) whose input index o * stride - pad + tap lies inside [0, size):
// the others read zero padding. Used for rows (size H, P outputs) and columns (W, Q).
struct Span {
  int64_t lo, hi;
};
Span inside(int64_t size, int64_t outputs, int64_t stride, int64_t pad, int64_t tap) {
  const int64_t off = tap - pad;
  const int64_t lo = off >= 0 ? 0 : (-off + stride - 1) / stride;
  const int64_t last = size - 1 - off;  // o * stride <= last
  const int64_t hi = last < 0 ? 0 : std::min(outputs, last / stride + 1);
  return {std::min(lo, hi), hi};
}

// The spans of every kernel row r and column t, computed once per call: the divisions in
// inside() would otherwise cost more than the copies of LeNet's 9-float rows they bound.
struct Unfold {
  const Conv2dShape& s;
  int64_t P, Q;
  std::vector<Span> rows, cols;
  explicit Unfold(const Conv2dShape& shape) : s(shape), P(shape.P()), Q(shape.Q()) {
    for (int64_t r = 0; r < s.R; ++r) rows.push_back(inside(s.H, P, s.stride, s.pad, r));
    for (int64_t t = 0; t < s.S; ++t) cols.push_back(inside(s.W, Q, s.stride, s.pad, t));
  }
};

// Copies n floats by fixed-size vector moves. GCC turns a plain copy loop, or a loop of
// fixed-size memcpy calls, into a memcpy call whose overhead exceeds the copy itself for LeNet's
// 9-float rows; the empty asm statement (GCC and Clang) keeps the loop a loop.
typedef float Floats8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float Floats4 __attribute__((vector_size(16), aligned(4), may_alias));
inline void copy_floats(float* __restrict d, const float* __restrict s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    *reinterpret_cast<Floats8*>(d + i) = *reinterpret_cast<const Floats8*>(s + i);
    asm("" : : : "memory");
  }
  if (n - i >= 4) {
    *reinterpret_cast<Floats4*>(d + i) = *reinterpret_cast<const Floats4*>(s + i);
    i += 4;
  }
  if (n - i >= 2) {
    d[i] = s[i];
    d[i + 1] = s[i + 1];
    i += 2;
  }
  if (n - i >= 1) d[i] = s[i];
}

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
// Without padding and with stride 1 each (c, r) of a patch is S contiguous floats of x.
void im2col_rows(const Unfold& u, const float* __restrict x, int64_t B, float* __restrict rows) {
  const int64_t C = u.s.C, H = u.s.H, W = u.s.W, R = u.s.R, S = u.s.S;
  const int64_t stride = u.s.stride, pad = u.s.pad, P = u.P, Q = u.Q, CHW = C * H * W;
  const int64_t CRS = C * R * S;
  for (int64_t i = 0; i < B; ++i) {
    const float* xi = x + i * CHW;
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t q = 0; q < Q; ++q) {
        float* __restrict patch = rows + ((i * P + p) * Q + q) * CRS;
        if (stride == 1 && pad == 0) {
          for (int64_t c = 0; c < C; ++c) {
            copy_rect(patch + c * R * S, S, xi + (c * H + p) * W + q, W, R, S);
          }
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
          for (int64_t q = cols.lo; q < cols.hi; ++q) dxrow[q * s.stride + off] += d[q];
        }
      }
    }
  }
}

// Sum of x[0, n) in a fixed order: 16 running lanes (lane j takes every 16th element from j),
// then a fixed pairwise tree. Vectorizes without reassociating, so it is the same on any ISA.
float sum_lanes(const float* __restrict x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

// ---- Vectors of 16 and 8 lanes (GCC / Clang vector extensions) ----
// GCC and Clang lower a 16-float vector to one AVX-512 register, or to several narrower ones on
// other targets. Every lane computes what the scalar code would, so no result depends on the
// vector width (a + w * x contracts to an FMA, or not, alike in every lane and in scalar code).
typedef float F16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));

// Unaligned loads and stores through may_alias types of alignment 1. (A memcpy into the vector
// looks equivalent, but GCC 12 then moves byte vectors through general registers a byte at a
// time.)
template <class V>
struct Unaligned;
#define MGPU_UNALIGNED(V)                                                    \
  template <>                                                                \
  struct Unaligned<V> {                                                      \
    typedef V type __attribute__((aligned(1), may_alias));                   \
  };
MGPU_UNALIGNED(F16)
MGPU_UNALIGNED(F8)
MGPU_UNALIGNED(F4)
MGPU_UNALIGNED(U8x16)
MGPU_UNALIGNED(U8x8)
#undef MGPU_UNALIGNED

template <class V, class T>
inline V loadv(const T* p) {
  return *reinterpret_cast<const typename Unaligned<V>::type*>(p);
}
template <class T, class V>
inline void storev(T* p, V v) {
  *reinterpret_cast<typename Unaligned<V>::type*>(p) = v;
}
// Mask bytes as int lanes (0 or the byte). The empty asm keeps the bytes in a vector register:
// GCC 12 widens a byte vector it sees loaded from memory one byte at a time through general
// registers, ~8x slower.
template <class I, class B>
inline I widen_bytes(const uint8_t* p) {
  B b = loadv<B>(p);
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(b));
#endif
  return __builtin_convertvector(b, I);
}
inline F16 load16(const float* p) { return loadv<F16>(p); }
inline void store16(float* p, F16 v) { storev(p, v); }

// The types of an L-lane chunk of a row: floats F, compare results I, bytes B, and half-width
// floats H with the even / odd lanes of F (2x2 pooling pairs adjacent columns) and back.
template <int L>
struct Lanes;
template <>
struct Lanes<16> {
  using F = F16;
  using I = I16;
  using B = U8x16;
  using H = F8;
  static H evens(F v) { return __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14); }
  static H odds(F v) { return __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15); }
  static F twice(H v) {
    return __builtin_shufflevector(v, v, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  }
};
template <>
struct Lanes<8> {
  using F = F8;
  using I = I8;
  using B = U8x8;
  using H = F4;
  static H evens(F v) { return __builtin_shufflevector(v, v, 0, 2, 4, 6); }
  static H odds(F v) { return __builtin_shufflevector(v, v, 1, 3, 5, 7); }
  static F twice(H v) { return __builtin_shufflevector(v, v, 0, 0, 1, 1, 2, 2, 3, 3); }
};

// Calls fn(q0) for the L-column chunks of a row pooled by 2x2 windows (2 * (Q / 2) >= L): q0 = 0,
// L, 2L, ... and last 2 * (Q / 2) - L, even so that column pairs stay aligned, overlapping the
// chunk before (which then computes the same values again).
template <int L, class Fn>
inline void for_each_pool2_chunk(int64_t Q, const Fn& fn) {
  const int64_t last = 2 * (Q / 2) - L;
  for (int64_t q0 = 0;; q0 += L) {
    if (q0 > last) q0 = last;
    fn(q0);
    if (q0 == last) break;
  }
}

// Tables of a kernel template's instances by size, so a runtime size (a tap count, a tail tile)
// picks code compiled for it: table_1_to<N>(make)[n - 1] is make(integral_constant<int, n>), and
// table_1_to<N, M>(make)[a - 1][b - 1] is make(a, b) likewise.
template <class Make, int... kI>
constexpr auto table_by_size(Make make, std::integer_sequence<int, kI...>) {
  return std::array{make(std::integral_constant<int, kI + 1>{})...};
}
template <int kN, class Make>
constexpr auto table_1_to(Make make) {
  return table_by_size(make, std::make_integer_sequence<int, kN>{});
}
template <int kRows, int kCols, class Make>
constexpr auto table_1_to(Make make) {
  return table_1_to<kRows>([make](auto a) {
    return table_1_to<kCols>([make, a](auto b) { return make(a, b); });
  });
}

// ---- Direct convolution for few taps ----
// With C*R*S taps <= kDirectMaxTaps, stride 1 and no padding, each output row is computed as
// sixteen lanes at a time straight from x: lane q of tap j = (c, r, t) reads x[c, p + r, q + t],
// so the taps of a row chunk are kTaps unaligned loads, kept in registers while every output
// channel is multiplied out. The chunks of a row start at 0, 16, 32, ... and the last one at
// Q - 16 (hence Q >= 16), overlapping the one before: the overlap recomputes the same lanes with
// the same operations, and every load stays inside the row of x it starts in.
constexpr int64_t kDirectMaxTaps = 16;
constexpr int64_t kLanes16 = 16;

bool use_direct(const Conv2dShape& s) {
  return s.stride == 1 && s.pad == 0 && s.C * s.R * s.S <= kDirectMaxTaps && s.Q() >= kLanes16;
}

// The offset of tap j = (c, r, t) from x[c = 0, p, q] in an image (C, H, W).
template <int kTaps>
std::array<int64_t, kTaps> tap_offsets(const Conv2dShape& s) {
  std::array<int64_t, kTaps> off{};
  for (int j = 0; j < kTaps; ++j) {
    const int64_t c = j / (s.R * s.S), r = (j / s.S) % s.R, t = j % s.S;
    off[static_cast<size_t>(j)] = (c * s.H + r) * s.W + t;
  }
  return off;
}

// One image: out (K, P*Q) = conv(x, w) without bias, each output the taps' products added in
// (c, r, t) order, starting from the first product.
template <int kTaps>
void direct_forward_image(const Conv2dShape& s, const float* __restrict x,
                          const float* __restrict w, float* __restrict out) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, last = Q - kLanes16;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  for (int64_t p = 0; p < P; ++p) {
    const float* xp = x + p * s.W;
    for (int64_t q0 = 0;; q0 += kLanes16) {
      if (q0 > last) q0 = last;
      F16 xv[kTaps];
      for (int j = 0; j < kTaps; ++j) xv[j] = load16(xp + off[static_cast<size_t>(j)] + q0);
      float* o = out + p * Q + q0;
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        F16 acc = xv[0] * wk[0];
        for (int j = 1; j < kTaps; ++j) acc += xv[j] * wk[j];
        store16(o + k * PQ, acc);
      }
      if (q0 == last) break;
    }
  }
}

// Adds a vector's lanes in a fixed pairwise tree: lane j + 8 onto lane j, then j + 4, j + 2, j + 1.
inline float sum16(F16 v) {
  const F8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One block of B images: dw (K, C*R*S) and, unless null, db (K) of the block, with dy's chunks
// from dy_chunk(k, i, p, q0) (16 lanes of image i, channel k, row p from column q0). Each sum runs
// in sixteen lanes over the block's (image, row, chunk) in order, then the lanes are added in a
// fixed tree. The last chunk of a row starts at Q - 16 like forward's, with the lanes the chunk
// before already counted set to zero.
template <int kTaps, class DyChunk>
void direct_dw_block(const Conv2dShape& s, const float* __restrict x, int64_t B,
                     const DyChunk& dy_chunk, float* __restrict dw, float* __restrict db) {
  const int64_t P = s.P(), Q = s.Q(), CHW = s.C * s.H * s.W;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  const int64_t full = Q / kLanes16 * kLanes16;  // columns covered by whole chunks
  I16 lane;
  for (int j = 0; j < kLanes16; ++j) lane[j] = j;
  const I16 keep_tail = lane >= static_cast<int32_t>(kLanes16 - (Q - full));
  const F16 zero = {};
  for (int64_t k = 0; k < s.K; ++k) {
    F16 acc[kTaps] = {};
    F16 accb = {};
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t p = 0; p < P; ++p) {
        const float* xp = x + i * CHW + p * s.W;
        for (int64_t q0 = 0; q0 < full; q0 += kLanes16) {
          const F16 d = dy_chunk(k, i, p, q0);
          accb += d;
          for (int j = 0; j < kTaps; ++j) {
            acc[j] += d * load16(xp + off[static_cast<size_t>(j)] + q0);
          }
        }
        if (full < Q) {
          const int64_t q0 = Q - kLanes16;
          const F16 d = keep_tail ? dy_chunk(k, i, p, q0) : zero;
          accb += d;
          for (int j = 0; j < kTaps; ++j) {
            acc[j] += d * load16(xp + off[static_cast<size_t>(j)] + q0);
          }
        }
      }
    }
    for (int j = 0; j < kTaps; ++j) dw[k * kTaps + j] = sum16(acc[j]);
    if (db) db[k] = sum16(accb);
  }
}

// direct_dw_block with dy (K, B*P*Q, image-major columns, rows ld floats apart).
template <int kTaps>
void direct_backward_block(const Conv2dShape& s, const float* __restrict x, int64_t B,
                           const float* __restrict dy, int64_t ld, float* __restrict dw,
                           float* __restrict db) {
  const int64_t PQ = s.P() * s.Q(), Q = s.Q();
  direct_dw_block<kTaps>(
      s, x, B,
      [&](int64_t k, int64_t i, int64_t p, int64_t q0) {
        return load16(dy + k * ld + i * PQ + p * Q + q0);
      },
      dw, db);
}

// direct_dw_block with dy = relu_pool_grad_plane(mask, dpooled) for 2x2 windows, made chunk by
// chunk as it is consumed instead of stored: the same values (dpooled / 4 where mask is set, zero
// elsewhere and where no window reaches), so the same bits. mask and dpooled start at the block.
template <int kTaps>
void direct_pool2_backward_block(const Conv2dShape& s, const float* __restrict x, int64_t B,
                                 const uint8_t* __restrict mask, const float* __restrict dpooled,
                                 float* __restrict dw, float* __restrict db) {
  using T = Lanes<16>;
  const int64_t P = s.P(), Q = s.Q(), Pp = P / 2, Qp = Q / 2;
  const F16 zero = {};
  direct_dw_block<kTaps>(
      s, x, B,
      [&](int64_t k, int64_t i, int64_t p, int64_t q0) {
        if (p >= 2 * Pp) return zero;
        const float* dp = dpooled + ((i * s.K + k) * Pp + p / 2) * Qp;
        F16 up;
        if (q0 % 2 == 0 && q0 + kLanes16 <= 2 * Qp) {
          up = T::twice(loadv<F8>(dp + q0 / 2) * 0.25f);
        } else {
          for (int l = 0; l < kLanes16; ++l) {
            const int64_t q = q0 + l;
            up[l] = q < 2 * Qp ? dp[q / 2] * 0.25f : 0.0f;
          }
        }
        const I16 keep = widen_bytes<I16, U8x16>(mask + ((i * s.K + k) * P + p) * Q + q0) != 0;
        return keep ? up : zero;
      },
      dw, db);
}

// direct_forward_image fused with bias, relu and 2x2 average pooling (LeNet's first block): rows
// are computed in pairs, and each pair's chunk goes from registers to mask and pooled, with the
// operations of bias_relu_pool2_plane on the same sums, so the bits of the unfused chain. Chunks
// go as for_each_pool2_chunk says; an odd Q's last column and an odd P's last row (no window
// covers them) only get their mask.
// mask may be null.
template <int kTaps>
void direct_relu_pool2_image(const Conv2dShape& s, const float* __restrict x,
                             const float* __restrict w, const float* __restrict b,
                             uint8_t* __restrict mask, float* __restrict pooled) {
  using T = Lanes<16>;
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, Pp = P / 2, Qp = Q / 2;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  const F16 zero = {};
  // The sum of one output by the vector lanes' operations, for the columns no chunk covers.
  auto sum_at = [&](int64_t k, int64_t p, int64_t q) {
    const float* xp = x + p * s.W + q;
    const float* wk = w + k * kTaps;
    float acc = xp[off[0]] * wk[0];
    for (int j = 1; j < kTaps; ++j) acc += xp[off[static_cast<size_t>(j)]] * wk[j];
    return acc;
  };
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const float* x0 = x + 2 * pp * s.W;
    const float* x1 = x0 + s.W;
    for_each_pool2_chunk<kLanes16>(Q, [&](int64_t q0) {
      F16 a[kTaps], c[kTaps];
      for (int j = 0; j < kTaps; ++j) {
        a[j] = load16(x0 + off[static_cast<size_t>(j)] + q0);
        c[j] = load16(x1 + off[static_cast<size_t>(j)] + q0);
      }
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        F16 acc0 = a[0] * wk[0], acc1 = c[0] * wk[0];
        for (int j = 1; j < kTaps; ++j) {
          acc0 += a[j] * wk[j];
          acc1 += c[j] * wk[j];
        }
        const float bias = b ? b[k] : 0.0f;
        const F16 y0 = acc0 + bias, y1 = acc1 + bias;
        const I16 k0 = y0 > zero, k1 = y1 > zero;
        if (mask) {
          uint8_t* m0 = mask + k * PQ + 2 * pp * Q + q0;
          storev(m0, __builtin_convertvector(k0 & 1, U8x16));
          storev(m0 + Q, __builtin_convertvector(k1 & 1, U8x16));
        }
        const F16 sum = (k0 ? y0 : zero) + (k1 ? y1 : zero);
        storev(pooled + (k * Pp + pp) * Qp + q0 / 2, (T::evens(sum) + T::odds(sum)) * 0.25f);
      }
    });
    if (mask && Q % 2 == 1) {  // odd Q: the last column
      for (int64_t k = 0; k < s.K; ++k) {
        const float bias = b ? b[k] : 0.0f;
        mask[k * PQ + 2 * pp * Q + Q - 1] = sum_at(k, 2 * pp, Q - 1) + bias > 0.0f;
        mask[k * PQ + (2 * pp + 1) * Q + Q - 1] = sum_at(k, 2 * pp + 1, Q - 1) + bias > 0.0f;
      }
    }
  }
  if (mask && P % 2 == 1) {  // odd P: the last row, as direct_forward_image computes it
    const int64_t p = P - 1;
    for (int64_t q0 = 0;; q0 += kLanes16) {
      if (q0 > Q - kLanes16) q0 = Q - kLanes16;
      F16 a[kTaps];
      for (int j = 0; j < kTaps; ++j) a[j] = load16(x + p * s.W + off[static_cast<size_t>(j)] + q0);
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        F16 acc = a[0] * wk[0];
        for (int j = 1; j < kTaps; ++j) acc += a[j] * wk[j];
        const F16 y = acc + (b ? b[k] : 0.0f);
        storev(mask + k * PQ + p * Q + q0, __builtin_convertvector((y > zero) & 1, U8x16));
      }
      if (q0 == Q - kLanes16) break;
    }
  }
}

constexpr auto kDirectForward =
    table_1_to<kDirectMaxTaps>([](auto n) { return &direct_forward_image<decltype(n)::value>; });
constexpr auto kDirectBackward =
    table_1_to<kDirectMaxTaps>([](auto n) { return &direct_backward_block<decltype(n)::value>; });
constexpr auto kDirectReluPool2 = table_1_to<kDirectMaxTaps>(
    [](auto n) { return &direct_relu_pool2_image<decltype(n)::value>; });
constexpr auto kDirectPool2Backward = table_1_to<kDirectMaxTaps>(
    [](auto n) { return &direct_pool2_backward_block<decltype(n)::value>; });

// dx (B, C, H, W) of a block from dy as direct_backward_block reads it: each dx element gathers
// w[k, c, r, t] * dy[k, h - r, v - t] in (k, r, t, p, q) order. Not on LeNet's path (its first
// layer needs no dx), so plain loops.
void direct_backward_dx(const Conv2dShape& s, const float* __restrict w, int64_t B,
                        const float* __restrict dy, int64_t ld, float* __restrict dx) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, CHW = s.C * s.H * s.W;
  std::fill(dx, dx + B * CHW, 0.0f);
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t c = 0; c < s.C; ++c) {
      float* dxc = dx + i * CHW + c * s.H * s.W;
      for (int64_t k = 0; k < s.K; ++k) {
        const float* dyk = dy + k * ld + i * PQ;
        for (int64_t r = 0; r < s.R; ++r) {
          for (int64_t t = 0; t < s.S; ++t) {
            const float wv = w[((k * s.C + c) * s.R + r) * s.S + t];
            for (int64_t p = 0; p < P; ++p) {
              float* __restrict dst = dxc + (p + r) * s.W + t;
              const float* __restrict src = dyk + p * Q;
              for (int64_t q = 0; q < Q; ++q) dst[q] += wv * src[q];
            }
          }
        }
      }
    }
  }
}

// ---- Batch in lanes: 16 images side by side (LeNet's conv2) ----
// For the other convolutions with stride 1 and no padding, a block of 16 images is laid out
// with the image index innermost, x as xT (C, H, W, 16), so one vector holds a pixel of all 16
// images, and the three products run as register tiles of such vectors: output channels x
// output columns (forward), output channels x taps (dw), input channels x input columns (dx).
// Every weight is a broadcast, every image a lane: no im2col matrix, no packing, and the
// arithmetic is all FMAs on full vectors. Each sum runs over a fixed order (forward and dx: the
// taps; dw: the block's pixels, then the 16 lanes in a fixed tree), so the bits depend on the
// shape alone. Missing images of a short last block are zero lanes.
constexpr int64_t kLaneBlock = 16;
// Tiles: at most 8 x 3 forward, 5 x 5 dw, 5 x 5 and 10 x 1 dx accumulators (<= 25 vectors, so
// they stay in AVX-512's 32 registers next to the operands). Chosen by alternating timed runs of
// LeNet's conv2 on one core: forward 5 x 3 -> 8 x 3 was ~14% faster, dx 4 x 5 -> 5 x 5 ~4%;
// 10 x 2 forward and 2 x 10 dw ran out of registers (~1.3-1.8x slower).
constexpr int kFwdKT = 8, kFwdQT = 3, kDwKT = 5, kDwJT = 5, kDxCT = 5, kDxWT = 5;
// Border columns of dx: one column, up to 10 input channels.
constexpr int kDxColumnCT = 10;

bool use_lanes(const Conv2dShape& s) {
  return s.stride == 1 && s.pad == 0 && !use_direct(s) &&
         kLaneBlock * (s.C * s.H * s.W + 2 * s.K * s.P() * s.Q()) <= (int64_t{1} << 22);
}

// Transposes a 16 x 16 tile held as 16 row vectors, in place: v[j][i] becomes the old v[i][j].
// Rounds d = 8, 4, 2, 1 swap the off-diagonal d x d blocks: rows a and a + d (bit d of a clear)
// become, block by block, the even-numbered blocks of both rows and the odd-numbered ones, one
// two-input shuffle each. Lane l of the result reads block l / d of x (even) or y (odd).
template <int kD, int kHalf, size_t... kL>
inline F16 swap_blocks(F16 x, F16 y, std::index_sequence<kL...>) {
  return __builtin_shufflevector(
      x, y, static_cast<int>((kL / kD % 2) * 16 + kL / kD / 2 * 2 * kD + kHalf * kD + kL % kD)...);
}
template <int kD>
inline void transpose_round(F16* v) {
  for (int a = 0; a < 16; ++a) {
    if (a & kD) continue;
    const F16 x = v[a], y = v[a + kD];
    v[a] = swap_blocks<kD, 0>(x, y, std::make_index_sequence<16>{});
    v[a + kD] = swap_blocks<kD, 1>(x, y, std::make_index_sequence<16>{});
  }
}
inline void transpose16(F16* v) {
  transpose_round<8>(v);
  transpose_round<4>(v);
  transpose_round<2>(v);
  transpose_round<1>(v);
}

// xT (E, 16) from B <= 16 rows of x, rows e_stride floats apart: xT[e, i] = x[i, e], zero for
// i >= B. Sixteen columns at a time through transpose16, the last E % 16 one by one.
void to_lanes(const float* __restrict x, int64_t e_stride, int64_t B, int64_t E,
              float* __restrict xT) {
  const F16 zero = {};
  const int64_t full = E / kLaneBlock * kLaneBlock;
  for (int64_t e0 = 0; e0 < full; e0 += kLaneBlock) {
    F16 v[kLaneBlock];
    for (int64_t i = 0; i < kLaneBlock; ++i) v[i] = i < B ? load16(x + i * e_stride + e0) : zero;
    transpose16(v);
    for (int64_t e = 0; e < kLaneBlock; ++e) store16(xT + (e0 + e) * kLaneBlock, v[e]);
  }
  for (int64_t e = full; e < E; ++e) {
    F16 v = zero;
    for (int64_t i = 0; i < B; ++i) v[i] = x[i * e_stride + e];
    store16(xT + e * kLaneBlock, v);
  }
}

// The inverse: x[i, e] = xT[e, i] for i < B.
void from_lanes(const float* __restrict xT, int64_t E, int64_t B, float* __restrict x,
                int64_t e_stride) {
  const int64_t full = E / kLaneBlock * kLaneBlock;
  for (int64_t e0 = 0; e0 < full; e0 += kLaneBlock) {
    F16 v[kLaneBlock];
    for (int64_t e = 0; e < kLaneBlock; ++e) v[e] = load16(xT + (e0 + e) * kLaneBlock);
    transpose16(v);
    for (int64_t i = 0; i < B; ++i) store16(x + i * e_stride + e0, v[i]);
  }
  for (int64_t e = full; e < E; ++e) {
    for (int64_t i = 0; i < B; ++i) x[i * e_stride + e] = xT[e * kLaneBlock + i];
  }
}

// Forward tile: outT[k0 + a, p, q0 + m] for a < KT, m < QT, summed over the taps (c, r, t) in
// order from zero. wT is w as (C*R*S, K).
template <int KT, int QT>
void lanes_forward_tile(const Conv2dShape& s, const float* __restrict xT,
                        const float* __restrict wT, int64_t p, int64_t q0, int64_t k0,
                        float* __restrict outT) {
  F16 acc[KT][QT] = {};
  const int64_t P = s.P(), Q = s.Q();
  int64_t j = 0;
  for (int64_t c = 0; c < s.C; ++c) {
    for (int64_t r = 0; r < s.R; ++r) {
      const float* xrow = xT + ((c * s.H + p + r) * s.W + q0) * kLaneBlock;
      for (int64_t t = 0; t < s.S; ++t, ++j) {
        F16 xv[QT];
#pragma GCC unroll 8
        for (int m = 0; m < QT; ++m) xv[m] = load16(xrow + (t + m) * kLaneBlock);
        const float* wj = wT + j * s.K + k0;
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
    for (int m = 0; m < QT; ++m) store16(outT + (((k0 + a) * P + p) * Q + q0 + m) * kLaneBlock,
                                         acc[a][m]);
  }
}

// dw tile: dw[k0 + a, j0 + b] for a < KT, b < JT (j = (c, r, t)) of one block, summed over the
// pixels (p, q) in order, then over the lanes. xoff[j] is tap j's offset (c*H + r)*W + t.
template <int KT, int JT>
void lanes_dw_tile(const Conv2dShape& s, const float* __restrict xT, const float* __restrict dyT,
                   const int64_t* __restrict xoff, int64_t k0, int64_t j0, float* __restrict dw) {
  F16 acc[KT][JT] = {};
  const int64_t P = s.P(), Q = s.Q(), CRS = s.C * s.R * s.S;
  const float* xj[JT];
  for (int b = 0; b < JT; ++b) xj[b] = xT + xoff[j0 + b] * kLaneBlock;
  const int64_t k_step = P * Q * kLaneBlock;
  for (int64_t p = 0; p < P; ++p) {
    const float* dyrow = dyT + (k0 * P + p) * Q * kLaneBlock;
    for (int64_t q = 0; q < Q; ++q) {
      const int64_t pix = (p * s.W + q) * kLaneBlock;
      F16 d[KT];
#pragma GCC unroll 8
      for (int a = 0; a < KT; ++a) d[a] = load16(dyrow + a * k_step + q * kLaneBlock);
#pragma GCC unroll 8
      for (int b = 0; b < JT; ++b) {
        const F16 xv = load16(xj[b] + pix);
#pragma GCC unroll 8
        for (int a = 0; a < KT; ++a) acc[a][b] += d[a] * xv;
      }
    }
  }
  for (int a = 0; a < KT; ++a) {
    for (int b = 0; b < JT; ++b) dw[(k0 + a) * CRS + j0 + b] = sum16(acc[a][b]);
  }
}

// dx tile for interior columns (those that see every tap t): dxT[c0 + a, h, w0 + m] for a < CT,
// m < WT, the sum of w[k, c, r, t] * dyT[k, h - r, w - t] over (k, r, t) in order from zero, r
// in [r_lo, r_hi] (the taps row h sees).
template <int CT, int WT>
void lanes_dx_tile(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                   int64_t h, int64_t r_lo, int64_t r_hi, int64_t w0, int64_t c0,
                   float* __restrict dxT) {
  F16 acc[CT][WT] = {};
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t k = 0; k < s.K; ++k) {
    for (int64_t r = r_lo; r <= r_hi; ++r) {
      const float* dyrow = dyT + ((k * P + h - r) * Q + w0) * kLaneBlock;
      const float* wkr = w + ((k * s.C + c0) * s.R + r) * s.S;
      for (int64_t t = 0; t < s.S; ++t) {
        F16 dv[WT];
#pragma GCC unroll 8
        for (int m = 0; m < WT; ++m) dv[m] = load16(dyrow + (m - t) * kLaneBlock);
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
    for (int m = 0; m < WT; ++m) store16(dxT + (((c0 + a) * s.H + h) * s.W + w0 + m) * kLaneBlock,
                                         acc[a][m]);
  }
}

// dx of one border column v (it sees only the taps t in [t_lo, t_hi]) for CT input channels: the
// sum over (r, t, k) in order from zero, k innermost so the short tap ranges cost no loop
// overhead.
template <int CT>
void lanes_dx_column(const Conv2dShape& s, const float* __restrict w, const float* __restrict dyT,
                     int64_t h, int64_t r_lo, int64_t r_hi, int64_t v, int64_t t_lo, int64_t t_hi,
                     int64_t c0, float* __restrict dxT) {
  F16 acc[CT] = {};
  const int64_t P = s.P(), Q = s.Q(), RS = s.R * s.S, CRS = s.C * RS;
  const int64_t k_step = P * Q * kLaneBlock;
  for (int64_t r = r_lo; r <= r_hi; ++r) {
    for (int64_t t = t_lo; t <= t_hi; ++t) {
      const float* dv = dyT + ((h - r) * Q + v - t) * kLaneBlock;
      const float* wv = w + (c0 * s.R + r) * s.S + t;
      for (int64_t k = 0; k < s.K; ++k, dv += k_step, wv += CRS) {
        const F16 d = load16(dv);
#pragma GCC unroll 16
        for (int a = 0; a < CT; ++a) acc[a] += d * wv[a * RS];
      }
    }
  }
  for (int a = 0; a < CT; ++a) store16(dxT + (((c0 + a) * s.H + h) * s.W + v) * kLaneBlock, acc[a]);
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

// One block's forward: outT (K, P, Q, 16) from xT.
void lanes_forward(const Conv2dShape& s, const float* xT, const float* wT, float* outT) {
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t q0 = 0; q0 < Q; q0 += kFwdQT) {
      const int64_t nq = std::min<int64_t>(kFwdQT, Q - q0);
      for (int64_t k0 = 0; k0 < s.K; k0 += kFwdKT) {
        const int64_t nk = std::min<int64_t>(kFwdKT, s.K - k0);
        kLanesForward[static_cast<size_t>(nk - 1)][static_cast<size_t>(nq - 1)](s, xT, wT, p, q0,
                                                                                k0, outT);
      }
    }
  }
}

// One block's dw (K, C*R*S) from xT and dyT (K, P, Q, 16).
void lanes_dw(const Conv2dShape& s, const float* xT, const float* dyT, const int64_t* xoff,
              float* dw) {
  const int64_t CRS = s.C * s.R * s.S;
  for (int64_t k0 = 0; k0 < s.K; k0 += kDwKT) {
    const int64_t nk = std::min<int64_t>(kDwKT, s.K - k0);
    for (int64_t j0 = 0; j0 < CRS; j0 += kDwJT) {
      const int64_t nj = std::min<int64_t>(kDwJT, CRS - j0);
      kLanesDw[static_cast<size_t>(nk - 1)][static_cast<size_t>(nj - 1)](s, xT, dyT, xoff, k0, j0,
                                                                         dw);
    }
  }
}

// One block's dxT (C, H, W, 16) from dyT. Row h sees the taps r in [max(0, h - P + 1),
// min(R - 1, h)], column v the taps t in [max(0, v - Q + 1), min(S - 1, v)]: the interior
// columns, which see all S, go in tiles of kDxWT columns, the border columns one at a time.
void lanes_dx(const Conv2dShape& s, const float* w, const float* dyT, float* dxT) {
  const int64_t P = s.P(), Q = s.Q();
  const int64_t in_lo = s.S - 1, in_hi = std::max(in_lo, Q);  // interior columns [in_lo, in_hi)
  for (int64_t h = 0; h < s.H; ++h) {
    const int64_t r_lo = std::max<int64_t>(0, h - P + 1), r_hi = std::min<int64_t>(s.R - 1, h);
    for (int64_t v = 0; v < s.W; ++v) {
      if (v == in_lo && in_hi > in_lo) {
        for (int64_t w0 = in_lo; w0 < in_hi; w0 += kDxWT) {
          const int64_t nw = std::min<int64_t>(kDxWT, in_hi - w0);
          for (int64_t c0 = 0; c0 < s.C; c0 += kDxCT) {
            const int64_t nc = std::min<int64_t>(kDxCT, s.C - c0);
            kLanesDx[static_cast<size_t>(nc - 1)][static_cast<size_t>(nw - 1)](
                s, w, dyT, h, r_lo, r_hi, w0, c0, dxT);
          }
        }
        v = in_hi - 1;
        continue;
      }
      const int64_t t_lo = std::max<int64_t>(0, v - Q + 1), t_hi = std::min<int64_t>(s.S - 1, v);
      for (int64_t c0 = 0; c0 < s.C; c0 += kDxColumnCT) {
        const int64_t nc = std::min<int64_t>(kDxColumnCT, s.C - c0);
        kLanesDxColumn[static_cast<size_t>(nc - 1)](s, w, dyT, h, r_lo, r_hi, v, t_lo, t_hi, c0,
                                                    dxT);
      }
    }
  }
}

// The forward product, block by block: unfolds each block of B images, multiplies, and hands
// the block's (K, B*P*Q) product (image-major columns, ld = B*P*Q) to emit(out, ld, n0, B), which
// runs on the worker that computed it while the product is still in its cache.
template <class Emit>
void forward_blocks(const Conv2dShape& s, const float* x, const float* w, const Emit& emit) {
  const int64_t PQ = s.P() * s.Q(), CRS = s.C * s.R * s.S, CHW = s.C * s.H * s.W;
  if (use_direct(s)) {  // one image at a time: the product is (K, P*Q), ld = P*Q
    const auto direct = kDirectForward[static_cast<size_t>(CRS - 1)];
    parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
      float* out = scratch(tl_mat, s.K * PQ);
      for (int64_t n = blk * kBlock; n < std::min(s.N, (blk + 1) * kBlock); ++n) {
        direct(s, x + n * CHW, w, out);
        emit(out, PQ, n, 1);
      }
    });
    return;
  }
  if (use_lanes(s)) {  // blocks of 16 images in lanes; the product goes back to (K, B*P*Q)
    float* wT = scratch(tl_weights, s.K * CRS);  // w as (C*R*S, K)
    for (int64_t k = 0; k < s.K; ++k) {
      for (int64_t j = 0; j < CRS; ++j) wT[j * s.K + k] = w[k * CRS + j];
    }
    parallel_for((s.N + kLaneBlock - 1) / kLaneBlock, [&](int64_t blk) {
      const int64_t n0 = blk * kLaneBlock, B = std::min(s.N - n0, kLaneBlock), ld = B * PQ;
      float* xT = scratch(tl_lanes, kLaneBlock * (CHW + s.K * PQ));
      float* outT = xT + kLaneBlock * CHW;
      float* out = scratch(tl_mat, s.K * ld);
      to_lanes(x + n0 * CHW, CHW, B, CHW, xT);
      lanes_forward(s, xT, wT, outT);
      for (int64_t k = 0; k < s.K; ++k) {
        from_lanes(outT + k * PQ * kLaneBlock, PQ, B, out + k * ld, PQ);
      }
      emit(out, ld, n0, B);
    });
    return;
  }
  const Unfold u(s);
  parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t n0 = blk * kBlock, B = std::min(s.N - n0, kBlock), ld = B * PQ;
    float* col = scratch(tl_col, CRS * ld);
    float* out = scratch(tl_mat, s.K * ld);
    im2col(u, x + n0 * CHW, B, col, ld);
    sgemm(false, false, s.K, ld, CRS, 1.0f, w, CRS, col, ld, 0.0f, out, ld);
    emit(out, ld, n0, B);
  });
}

// The backward products, block by block: load(dyb, ld, n0, B) writes the block's dy as (K, B*P*Q)
// (image-major columns, ld = B*P*Q); then dw and db of the block go to their slot and dx is
// scattered back from dcol. The slots are added in block order at the end (see kBlock).
// direct_dw, when given, computes a block's dw and db on the direct path without dx instead of
// load and direct_backward_block: direct_dw(n0, B, dw, db).
using DirectDw = std::function<void(int64_t, int64_t, float*, float*)>;
template <class Load>
void backward_blocks(const Conv2dShape& s, const float* x, const float* w, const Load& load,
                     float* dx, float* dw, float* db, const DirectDw& direct_fused = nullptr) {
  const int64_t PQ = s.P() * s.Q(), CRS = s.C * s.R * s.S, CHW = s.C * s.H * s.W;
  const int64_t KCRS = s.K * CRS, RS = s.R * s.S;
  const Unfold u(s);
  if (s.N == 0) {
    std::fill(dw, dw + KCRS, 0.0f);
    if (db) std::fill(db, db + s.K, 0.0f);
    return;
  }
  // dw from patch rows (im2col_rows) where a patch is long enough to fill cache lines (conv2's
  // 500 floats); LeNet's conv1 (9-float patches) is faster from col with the transpose flag.
  // A function of the shape alone, so every thread count takes the same path.
  const bool patch_rows = CRS >= kPatchRowsMin;
  // Block 0 writes straight into dw and db; blocks 1.. into slots in this thread's scratch.
  const bool lanes = use_lanes(s);
  const int64_t block = lanes ? kLaneBlock : kBlock;
  const int64_t blocks = (s.N + block - 1) / block;
  float* slots = scratch(tl_slots, (blocks - 1) * (KCRS + s.K));
  auto dw_slot = [&](int64_t blk) { return blk == 0 ? dw : slots + (blk - 1) * KCRS; };
  auto db_slot = [&](int64_t blk) {
    return blk == 0 ? db : slots + (blocks - 1) * KCRS + (blk - 1) * s.K;
  };

  const bool direct = use_direct(s);
  const auto direct_dw = direct ? kDirectBackward[static_cast<size_t>(CRS - 1)] : nullptr;
  int64_t* xoff = nullptr;  // tap j = (c, r, t) of the lanes' dw: its offset in an image
  if (lanes) {
    if (static_cast<int64_t>(tl_offsets.size()) < CRS) tl_offsets.resize(static_cast<size_t>(CRS));
    xoff = tl_offsets.data();
    int64_t j = 0;
    for (int64_t c = 0; c < s.C; ++c) {
      for (int64_t r = 0; r < s.R; ++r) {
        for (int64_t t = 0; t < s.S; ++t) xoff[j++] = (c * s.H + r) * s.W + t;
      }
    }
  }

  parallel_for(blocks, [&](int64_t blk) {
    const int64_t n0 = blk * block, B = std::min(s.N - n0, block), ld = B * PQ;
    if (direct && direct_fused && !dx) {
      direct_fused(n0, B, dw_slot(blk), db ? db_slot(blk) : nullptr);
      return;
    }
    float* dyb = scratch(tl_mat, s.K * ld);  // dy of the block as (K, B*P*Q)
    load(dyb, ld, n0, B);
    if (lanes) {
      float* xT = scratch(tl_lanes, kLaneBlock * (2 * CHW + s.K * PQ));
      float* dxT = xT + kLaneBlock * CHW;
      float* dyT = dxT + kLaneBlock * CHW;
      to_lanes(x + n0 * CHW, CHW, B, CHW, xT);
      for (int64_t k = 0; k < s.K; ++k) {
        to_lanes(dyb + k * ld, PQ, B, PQ, dyT + k * PQ * kLaneBlock);
      }
      lanes_dw(s, xT, dyT, xoff, dw_slot(blk));
      if (db) {
        float* dbs = db_slot(blk);
        for (int64_t k = 0; k < s.K; ++k) dbs[k] = sum_lanes(dyb + k * ld, ld);
      }
      if (dx) {
        lanes_dx(s, w, dyT, dxT);
        from_lanes(dxT, CHW, B, dx + n0 * CHW, CHW);
      }
      return;
    }
    if (direct) {
      direct_dw(s, x + n0 * CHW, B, dyb, ld, dw_slot(blk), db ? db_slot(blk) : nullptr);
      if (dx) direct_backward_dx(s, w, B, dyb, ld, dx + n0 * CHW);
      return;
    }
    float* col = scratch(tl_col, CRS * ld);  // col (or its transpose), then reused for dcol
    if (patch_rows) {
      im2col_rows(u, x + n0 * CHW, B, col);
      sgemm(false, false, s.K, CRS, ld, 1.0f, dyb, ld, col, CRS, 0.0f, dw_slot(blk), CRS);
    } else {
      im2col(u, x + n0 * CHW, B, col, ld);
      sgemm(false, true, s.K, CRS, ld, 1.0f, dyb, ld, col, ld, 0.0f, dw_slot(blk), CRS);
    }
    if (db) {
      float* dbs = db_slot(blk);
      for (int64_t k = 0; k < s.K; ++k) dbs[k] = sum_lanes(dyb + k * ld, ld);
    }
    if (dx) {
      // dcol = w^T * dy one input channel (R*S rows) at a time, each scattered into dx while it
      // is in L1: OpenBLAS multiplies these small products without packing or zeroing C first,
      // ~15% faster than one (C*R*S, B*P*Q) product, and col2im no longer reads dcol from L2.
      float* dxb = dx + n0 * CHW;
      std::fill(dxb, dxb + B * CHW, 0.0f);
      for (int64_t c = 0; c < s.C; ++c) {
        sgemm(true, false, RS, ld, s.K, 1.0f, w + c * RS, CRS, dyb, ld, 0.0f, col, ld);
        col2im_channel(u, col, ld, B, c, dxb);
      }
    }
  });

  if (blocks > 1) {
    parallel_for((KCRS + kReduceChunk - 1) / kReduceChunk, [&](int64_t chunk) {
      const int64_t i0 = chunk * kReduceChunk, i1 = std::min(KCRS, i0 + kReduceChunk);
      float* __restrict dst = dw;
      for (int64_t blk = 1; blk < blocks; ++blk) {
        const float* __restrict src = dw_slot(blk);
        for (int64_t i = i0; i < i1; ++i) dst[i] += src[i];
      }
    });
    if (db) {
      for (int64_t blk = 1; blk < blocks; ++blk) {
        const float* src = db_slot(blk);
        for (int64_t k = 0; k < s.K; ++k) db[k] += src[k];
      }
    }
  }
}

// Divides by a window's area. x / 4 and x * 0.25f are the same float (a power of two scales
// exactly), so LeNet's 2x2 windows multiply instead: a division per pooled value cost more than
// the rest of the pooling.
struct DivideByArea {
  float area, inverse;
  bool exact;
  explicit DivideByArea(int64_t n)
      : area(static_cast<float>(n)), inverse(1.0f / area), exact((n & (n - 1)) == 0) {}
  float operator()(float x) const { return exact ? x * inverse : x / area; }
};

// bias_relu_pool_plane for 2x2 windows, a row pair L columns at a time (needs 2 * (Q / 2) >= L;
// chunks as for_each_pool2_chunk says). The same operations per element as the scalar loops
// below, so the same bits.
template <int L>
void bias_relu_pool2_plane(const float* __restrict v, float bias, int64_t P, int64_t Q,
                           uint8_t* __restrict mask, float* __restrict pooled) {
  using T = Lanes<L>;
  using F = typename T::F;
  const int64_t Pp = P / 2, Qp = Q / 2;
  const F zero = {};
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const float* v0 = v + 2 * pp * Q;
    const float* v1 = v0 + Q;
    uint8_t* m0 = mask ? mask + 2 * pp * Q : nullptr;
    float* out = pooled + pp * Qp;
    for_each_pool2_chunk<L>(Q, [&](int64_t q0) {
      const F a0 = loadv<F>(v0 + q0) + bias, a1 = loadv<F>(v1 + q0) + bias;
      const typename T::I k0 = a0 > zero, k1 = a1 > zero;
      if (m0) {
        storev(m0 + q0, __builtin_convertvector(k0 & 1, typename T::B));
        storev(m0 + Q + q0, __builtin_convertvector(k1 & 1, typename T::B));
      }
      const F sum = (k0 ? a0 : zero) + (k1 ? a1 : zero);
      storev(out + q0 / 2, (T::evens(sum) + T::odds(sum)) * 0.25f);
    });
    if (m0 && Q % 2 == 1) {  // the column no window covers
      m0[Q - 1] = v0[Q - 1] + bias > 0.0f;
      m0[2 * Q - 1] = v1[Q - 1] + bias > 0.0f;
    }
  }
  if (mask) {  // the row no window covers
    for (int64_t j = 2 * Pp * Q; j < P * Q; ++j) mask[j] = v[j] + bias > 0.0f;
  }
}

// relu_pool_grad_plane for 2x2 windows, L columns at a time, chunked as bias_relu_pool2_plane.
template <int L>
void relu_pool2_grad_plane(const uint8_t* __restrict mask, const float* __restrict dpooled,
                           int64_t P, int64_t Q, float* __restrict dy) {
  using T = Lanes<L>;
  using I = typename T::I;
  const int64_t Pp = P / 2, Qp = Q / 2;
  const typename T::F zero = {};
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const uint8_t* m0 = mask + 2 * pp * Q;
    float* d0 = dy + 2 * pp * Q;
    const float* dp = dpooled + pp * Qp;
    for_each_pool2_chunk<L>(Q, [&](int64_t q0) {
      const typename T::F up = T::twice(loadv<typename T::H>(dp + q0 / 2) * 0.25f);
      const I k0 = widen_bytes<I, typename T::B>(m0 + q0) != 0;
      const I k1 = widen_bytes<I, typename T::B>(m0 + Q + q0) != 0;
      storev(d0 + q0, k0 ? up : zero);
      storev(d0 + Q + q0, k1 ? up : zero);
    });
    if (Q % 2 == 1) d0[Q - 1] = d0[2 * Q - 1] = 0.0f;
  }
  std::fill(dy + 2 * Pp * Q, dy + P * Q, 0.0f);
}

// One plane of the fused forward: with y = v + bias (P, Q), mask = (y > 0) and pooled =
// avg_pool(relu(y)) over pool x pool windows with stride pool (Pp, Qp). The sums run in
// avg_pool2d_forward's order (the window's rows first, then its columns), so the bits equal
// relu_forward then avg_pool2d_forward. mask may be null; acc holds Q floats.
void bias_relu_pool_plane(const float* __restrict v, float bias, int64_t P, int64_t Q, int64_t pool,
                          uint8_t* __restrict mask, float* __restrict pooled,
                          float* __restrict acc) {
  const int64_t Pp = P / pool, Qp = Q / pool;
  if (pool == 2 && 2 * Qp >= 16) return bias_relu_pool2_plane<16>(v, bias, P, Q, mask, pooled);
  if (pool == 2 && 2 * Qp >= 8) return bias_relu_pool2_plane<8>(v, bias, P, Q, mask, pooled);
  const DivideByArea divide(pool * pool);
  if (mask) {
    for (int64_t j = 0; j < P * Q; ++j) mask[j] = v[j] + bias > 0.0f;
  }
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const float* __restrict v0 = v + pp * pool * Q;
    float* __restrict out = pooled + pp * Qp;
    if (pool == 2) {  // LeNet's windows: the same sums, in loops of fixed shape that vectorize
      const float* __restrict v1 = v0 + Q;
      for (int64_t q = 0; q < 2 * Qp; ++q) {
        const float a0 = v0[q] + bias, a1 = v1[q] + bias;
        acc[q] = (a0 > 0.0f ? a0 : 0.0f) + (a1 > 0.0f ? a1 : 0.0f);
      }
      for (int64_t qq = 0; qq < Qp; ++qq) out[qq] = (acc[2 * qq] + acc[2 * qq + 1]) * 0.25f;
      continue;
    }
    for (int64_t q = 0; q < Q; ++q) {
      const float a = v0[q] + bias;
      acc[q] = a > 0.0f ? a : 0.0f;
    }
    for (int64_t i = 1; i < pool; ++i) {
      const float* __restrict vi = v0 + i * Q;
      for (int64_t q = 0; q < Q; ++q) {
        const float a = vi[q] + bias;
        acc[q] += a > 0.0f ? a : 0.0f;
      }
    }
    for (int64_t qq = 0; qq < Qp; ++qq) {
      const float* a = acc + qq * pool;
      float sum = a[0];
      for (int64_t j = 1; j < pool; ++j) sum += a[j];
      out[qq] = divide(sum);
    }
  }
}

// One plane of the fused backward: dy = mask * upsample(dpooled) / area, 0 in the rows and
// columns no window covers -- avg_pool2d_backward then relu_backward, bit for bit. up holds Q
// floats.
void relu_pool_grad_plane(const uint8_t* __restrict mask, const float* __restrict dpooled,
                          int64_t P, int64_t Q, int64_t pool, float* __restrict dy,
                          float* __restrict up) {
  const int64_t Pp = P / pool, Qp = Q / pool;
  if (pool == 2 && 2 * Qp >= 16) return relu_pool2_grad_plane<16>(mask, dpooled, P, Q, dy);
  if (pool == 2 && 2 * Qp >= 8) return relu_pool2_grad_plane<8>(mask, dpooled, P, Q, dy);
  const DivideByArea divide(pool * pool);
  for (int64_t q = Qp * pool; q < Q; ++q) up[q] = 0.0f;
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const float* __restrict dp = dpooled + pp * Qp;
    if (pool == 2) {  // LeNet's windows, without the inner loops of length 2
      for (int64_t qq = 0; qq < Qp; ++qq) {
        const float g = dp[qq] * 0.25f;
        up[2 * qq] = g;
        up[2 * qq + 1] = g;
      }
    } else {
      for (int64_t qq = 0; qq < Qp; ++qq) {
        const float g = divide(dp[qq]);
        for (int64_t j = 0; j < pool; ++j) up[qq * pool + j] = g;
      }
    }
    copy_rect(dy + pp * pool * Q, Q, up, 0, pool, Q);
  }
  std::fill(dy + Pp * pool * Q, dy + P * Q, 0.0f);
  // relu's mask in one pass over the plane: a select on byte masks vectorizes only over runs of
  // 32 or more (a 26-float row fell back to a branch per element, mispredicted half the time).
  for (int64_t j = 0; j < P * Q; ++j) dy[j] = mask[j] ? dy[j] : 0.0f;
}

}  // namespace

void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                    float* y) {
  const int64_t PQ = s.P() * s.Q(), KPQ = s.K * PQ;
  forward_blocks(s, x, w, [&](const float* out, int64_t ld, int64_t n0, int64_t B) {
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const float* __restrict src = out + k * ld + i * PQ;
        float* __restrict dst = y + (n0 + i) * KPQ + k * PQ;
        const float bias = b ? b[k] : 0.0f;
        for (int64_t j = 0; j < PQ; ++j) dst[j] = src[j] + bias;
      }
    }
  });
}

void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db) {
  const int64_t PQ = s.P() * s.Q(), KPQ = s.K * PQ;
  auto load = [&](float* dyb, int64_t ld, int64_t n0, int64_t B) {
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        copy_floats(dyb + k * ld + i * PQ, dy + (n0 + i) * KPQ + k * PQ, PQ);
      }
    }
  };
  backward_blocks(s, x, w, load, dx, dw, db);
}

void conv2d_relu_pool_forward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                              const float* b, uint8_t* mask, float* pooled) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q;
  const int64_t pooled_plane = (P / pool) * (Q / pool);
  if (use_direct(s) && pool == 2) {  // the whole block in registers, image by image
    const auto fused = kDirectReluPool2[static_cast<size_t>(s.C * s.R * s.S - 1)];
    const int64_t CHW = s.C * s.H * s.W;
    parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
      for (int64_t n = blk * kBlock; n < std::min(s.N, (blk + 1) * kBlock); ++n) {
        fused(s, x + n * CHW, w, b, mask ? mask + n * s.K * PQ : nullptr,
              pooled + n * s.K * pooled_plane);
      }
    });
    return;
  }
  forward_blocks(s, x, w, [&](const float* out, int64_t ld, int64_t n0, int64_t B) {
    float* acc = scratch(tl_row, Q);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t plane = (n0 + i) * s.K + k;
        bias_relu_pool_plane(out + k * ld + i * PQ, b ? b[k] : 0.0f, P, Q, pool,
                             mask ? mask + plane * PQ : nullptr, pooled + plane * pooled_plane,
                             acc);
      }
    }
  });
}

void conv2d_relu_pool_backward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                               const uint8_t* mask, const float* dpooled, float* dx, float* dw,
                               float* db) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q;
  const int64_t pooled_plane = (P / pool) * (Q / pool);
  auto load = [&](float* dyb, int64_t ld, int64_t n0, int64_t B) {
    float* up = scratch(tl_row, Q);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t plane = (n0 + i) * s.K + k;
        relu_pool_grad_plane(mask + plane * PQ, dpooled + plane * pooled_plane, P, Q, pool,
                             dyb + k * ld + i * PQ, up);
      }
    }
  };
  DirectDw direct_fused;
  if (use_direct(s) && pool == 2) {
    const auto fn = kDirectPool2Backward[static_cast<size_t>(s.C * s.R * s.S - 1)];
    const int64_t CHW = s.C * s.H * s.W;
    direct_fused = [&, fn, CHW](int64_t n0, int64_t B, float* dws, float* dbs) {
      fn(s, x + n0 * CHW, B, mask + n0 * s.K * PQ, dpooled + n0 * s.K * pooled_plane, dws, dbs);
    };
  }
  backward_blocks(s, x, w, load, dx, dw, db, direct_fused);
}

}  // namespace mgpu::ops::cpu
