// cpp/ops/conv2d_cpu/conv2d_cpu.h -- the pieces the CPU conv2d's three algorithms share
// (im2col.cpp, direct.cpp, lanes.cpp), the fused relu-pool planes (relu_pool.cpp), and what the
// block loops in cpp/ops/conv2d_cpu.cpp call in each. Internal to the CPU conv kernels.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

// Images per block (im2col and direct paths; the lane path uses kLaneBlock = 16): the unit of
// parallel work, and the unit of the batch sums in dw and db. Each block sums its images into its
// own slot and the slots are added in block order afterwards. The size is a constant, never
// derived from the thread count, so every thread count adds the same numbers in the same order
// and gives bitwise-equal results (shards that are multiples of it also keep their blocks when a
// batch is split across devices). 8 images make an im2col product 8 images wide, where OpenBLAS
// ran ~20% faster than one image at a time.
// Winograd F(4x4, 3x3)'s kernel transform G (6x3) for the points 0, 1, -1, 1/2, -2 and
// infinity, in double: winograd.cpp applies it to the weights, winograd_dw.cpp (as G^T dU G) to
// dU. Rows 0, 1, 2, 4 and 5 carry a factor 1/2 that B^T's rows carry as 2 (integer B^T).
constexpr double kWinogradG[6][3] = {
    {1.0 / 2, 0, 0},
    {1.0 / 6, 1.0 / 6, 1.0 / 6},
    {-1.0 / 6, 1.0 / 6, -1.0 / 6},
    {-16.0 / 15, -8.0 / 15, -4.0 / 15},
    {1.0 / 30, -1.0 / 15, 2.0 / 15},
    {0, 0, 1.0 / 2}};

constexpr int64_t kBlock = 8;

// The shortest patch (C*R*S floats) for which backward builds dw from im2col_rows (see there).
constexpr int64_t kPatchRowsMin = 64;

// Elements per task when adding the dw slots together; any size gives the same result.
constexpr int64_t kReduceChunk = 4096;

// Per-thread scratch, grown once to the largest shape seen and then reused, so steady-state
// training never allocates here. Workers use col, mat, row and lanes; the calling thread holds the
// slots, the lane path's packed weights and its tap offsets.
inline thread_local std::vector<float> tl_col, tl_mat, tl_row, tl_slots, tl_lanes, tl_weights;
inline thread_local std::vector<int64_t> tl_offsets;
// The calling thread's Winograd weights in the transformed domain (36 x K x C floats, 37.7 MB at
// 512 channels): the forward's and the data gradient's U (winograd.cpp) and the weight
// gradient's dU (winograd_dw.cpp) share it, since one call never needs two of them at once
// (winograd_backward finishes dw before it transforms the kernel for dx). One buffer per device
// thread instead of two.
inline thread_local std::vector<float> tl_transformed;

inline float* scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// The outputs o in [lo, hi) whose input index o * stride - pad + tap lies inside [0, size):
// the others read zero padding. Used for rows (size H, P outputs) and columns (W, Q).
struct Span {
  int64_t lo, hi;
};
inline Span inside(int64_t size, int64_t outputs, int64_t stride, int64_t pad, int64_t tap) {
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

// Int lanes holding 0 or 1 as mask bytes (each lane's low byte, the same value). On the AVX2
// path a byte shuffle: GCC 12 lowers __builtin_convertvector from 8 int lanes to 8 bytes there to
// a byte at a time through general registers (~35 instructions a vector: the fused
// conv-relu-pool forwards ran 1.4-2.3x as long as on the AVX-512 path, where AVX-512VL has one
// instruction for it, which this keeps).
inline U8x8 mask_bytes(I8 k) {
#if defined(__AVX512VL__)
  return __builtin_convertvector(k, U8x8);
#else
  typedef uint8_t U8x32 __attribute__((vector_size(32)));
  const U8x32 b = reinterpret_cast<U8x32>(k);
  return __builtin_shufflevector(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
#endif
}
#if defined(__AVX512F__)
inline U8x16 mask_bytes(I16 k) { return __builtin_convertvector(k, U8x16); }
#endif

// The types of an L-lane chunk of a row: floats F, compare results I, bytes B, and half-width
// floats H with the even / odd lanes of F (2x2 pooling pairs adjacent columns) and back.
template <int L>
struct Lanes;
#if defined(__AVX512F__)  // 16-float vectors only where they are one register
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
#endif
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

// ---- The vector width of this instruction-set path ----
// The kernels compute with kW-float vectors V: 16 (one zmm) on the AVX-512 path, 8 (one ymm) on
// the AVX2 path, whose 16 registers hold a tile of 8-float accumulators but not of 16-float ones.
// Layouts and sums stay 16 wide on both: blocks of 16 images in lanes, 16-column chunks and
// 16-lane partial sums; the AVX2 path computes each 16-lane step as kHalves = 2 halves of 8 lanes
// with the same operations in the same order, so both paths give the same bits.
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
constexpr int kHalves = 16 / kW;
using V = Lanes<kW>::F;
using VI = Lanes<kW>::I;
using VB = Lanes<kW>::B;
inline V loadw(const float* p) { return loadv<V>(p); }
inline void storew(float* p, V v) { storev(p, v); }

// Adds the 16 lanes of a partial sum, given as its kHalves vectors (lanes 0-7 and 8-15, or all
// 16), in a fixed pairwise tree: lane j + 8 onto lane j, then j + 4, j + 2, j + 1.
inline float sum16_tree(F8 a) {
  const F4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#if defined(__AVX512F__)
inline float sum16(const V* halves) {
  const V v = halves[0];
  return sum16_tree(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
#else
inline float sum16(const V* halves) { return sum16_tree(halves[0] + halves[1]); }
#endif

// ---- im2col.cpp: unfolding for the sgemm path, and rectangle copies ----
void copy_rect(float* __restrict d, int64_t dstride, const float* __restrict s, int64_t sstride,
               int64_t rows, int64_t n);
void im2col(const Unfold& u, const float* __restrict x, int64_t B, float* __restrict col,
            int64_t ld);
void im2col_rows(const Unfold& u, const float* __restrict x, int64_t B, float* __restrict rows);
void col2im_channel(const Unfold& u, const float* __restrict dcol, int64_t ld, int64_t B,
                    int64_t c, float* __restrict dx);

// ---- direct.cpp: few taps, sixteen output columns at a time ----
bool use_direct(const Conv2dShape& s);
// The kernels for taps = C*R*S (1 <= taps <= 16), compiled for that tap count.
using DirectForwardFn = void (*)(const Conv2dShape&, const float*, const float*, float*);
using DirectBackwardFn = void (*)(const Conv2dShape&, const float*, int64_t, const float*, int64_t,
                                  float*, float*);
using DirectReluPool2Fn = void (*)(const Conv2dShape&, const float*, const float*, const float*,
                                   uint8_t*, float*);
using DirectPool2BackwardFn = void (*)(const Conv2dShape&, const float*, int64_t, const uint8_t*,
                                       const float*, float*, float*);
DirectForwardFn direct_forward_kernel(int64_t taps);
DirectBackwardFn direct_backward_kernel(int64_t taps);
DirectReluPool2Fn direct_relu_pool2_kernel(int64_t taps);
DirectPool2BackwardFn direct_pool2_backward_kernel(int64_t taps);
void direct_backward_dx(const Conv2dShape& s, const float* __restrict w, int64_t B,
                        const float* __restrict dy, int64_t ld, float* __restrict dx);

// ---- lanes.cpp: blocks of kLaneBlock images side by side in vector lanes ----
constexpr int64_t kLaneBlock = 16;
// The lane kernels' register tiles, each its accumulators next to their operands and one broadcast
// weight in the register file (lanes.cpp; lanes_bf16.cpp's float32 emulation takes the same
// sizes on the AVX-512 path and its own on the AVX2 path):
// AVX-512 (32 zmm): at most 8 x 3 forward, 5 x 5 dw, 5 x 5 and 10 x 1 dx (<= 25 vectors). Chosen
// by alternating timed runs of LeNet's conv2 on one core: forward 5 x 3 -> 8 x 3 was ~14%
// faster, dx 4 x 5 -> 5 x 5 ~4%; 10 x 2 forward and 2 x 10 dw ran out of registers.
// AVX2 (16 ymm): 3 x 3 forward, 3 x 4 dw, 2 x 5 dx and 10 x 1 dx columns (<= 12 accumulators
// next to their loads and a broadcast). Chosen by CPU-time runs of LeNet's conv2 on one Zen 4
// core among 3x3 / 4x3 / 5x2 / 6x2 forward, 2x5 / 2x6 / 3x4 / 4x2 dw, 2x5 / 4x3 / 5x2 dx.
#ifndef MGPU_LANES_FWD_KT  // the AVX2 tiles can be set at compile time, to time alternatives
#define MGPU_LANES_FWD_KT 3
#define MGPU_LANES_FWD_QT 3
#define MGPU_LANES_DW_KT 3
#define MGPU_LANES_DW_JT 4
#define MGPU_LANES_DX_CT 2
#define MGPU_LANES_DX_WT 5
#endif
#if defined(__AVX512F__)
constexpr int kFwdKT = 8, kFwdQT = 3, kDwKT = 5, kDwJT = 5, kDxCT = 5, kDxWT = 5;
#else
constexpr int kFwdKT = MGPU_LANES_FWD_KT, kFwdQT = MGPU_LANES_FWD_QT, kDwKT = MGPU_LANES_DW_KT,
              kDwJT = MGPU_LANES_DW_JT, kDxCT = MGPU_LANES_DX_CT, kDxWT = MGPU_LANES_DX_WT;
#endif
// Border columns of dx: one column, up to 10 input channels (AVX-512), 5 with both halves'
// accumulators (AVX2: 10 of 16 registers).
#ifndef MGPU_LANES_DX_COLUMN_CT
#define MGPU_LANES_DX_COLUMN_CT 5
#endif
constexpr int kDxColumnCT = kW == 16 ? 10 : MGPU_LANES_DX_COLUMN_CT;

bool use_lanes(const Conv2dShape& s);
void to_lanes(const float* __restrict x, int64_t e_stride, int64_t B, int64_t E,
              float* __restrict xT);
void from_lanes(const float* __restrict xT, int64_t E, int64_t B, float* __restrict x,
                int64_t e_stride);
void pack_forward_weights(const Conv2dShape& s, const float* __restrict w, float* __restrict wP);
void lanes_forward(const Conv2dShape& s, const float* xT, const float* wP, float* outT);
void lanes_dw(const Conv2dShape& s, const float* xT, const float* dyT, const int64_t* xoff,
              float* dw);
void lanes_dx(const Conv2dShape& s, const float* w, const float* dyT, float* dxT);

// The block loops around the lane kernels' tiles, for lanes.cpp's float32 tiles and
// lanes_bf16.cpp's pair products alike: table[nk - 1][nq - 1] etc. is the tile kernel for a tile
// of that size (table_1_to), X and Wt the operands' types (floats, or packed pairs).
// The tile sizes are the tables' sizes.
template <class Table>
constexpr int64_t rows_of = std::tuple_size_v<Table>;
template <class Table>
constexpr int64_t cols_of = std::tuple_size_v<typename Table::value_type>;

template <class Table, class X, class Wt>
void lanes_forward_loops(const Table& table, const Conv2dShape& s, const X* x, const Wt* w,
                         float* outT) {
  constexpr int64_t KT = rows_of<Table>, QT = cols_of<Table>;
  const int64_t P = s.P(), Q = s.Q();
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t q0 = 0; q0 < Q; q0 += QT) {
      const int64_t nq = std::min<int64_t>(QT, Q - q0);
      for (int64_t k0 = 0; k0 < s.K; k0 += KT) {
        const int64_t nk = std::min<int64_t>(KT, s.K - k0);
        table[static_cast<size_t>(nk - 1)][static_cast<size_t>(nq - 1)](s, x, w, p, q0, k0, outT);
      }
    }
  }
}

template <class Table, class X>
void lanes_dw_loops(const Table& table, const Conv2dShape& s, const X* x, const X* dy,
                    const int64_t* xoff, float* dw) {
  constexpr int64_t KT = rows_of<Table>, JT = cols_of<Table>;
  const int64_t CRS = s.C * s.R * s.S;
  for (int64_t k0 = 0; k0 < s.K; k0 += KT) {
    const int64_t nk = std::min<int64_t>(KT, s.K - k0);
    for (int64_t j0 = 0; j0 < CRS; j0 += JT) {
      const int64_t nj = std::min<int64_t>(JT, CRS - j0);
      table[static_cast<size_t>(nk - 1)][static_cast<size_t>(nj - 1)](s, x, dy, xoff, k0, j0, dw);
    }
  }
}

// tail_columns: the interior columns past the last full tile go to the column kernel (given all
// the taps) instead of a narrower tile; only where both sum in the same order.
template <bool tail_columns = false, class Tiles, class Columns, class X, class Wt>
void lanes_dx_loops(const Tiles& tiles, const Columns& columns, const Conv2dShape& s,
                    const Wt* w, const X* dy, float* dxT) {
  constexpr int64_t CT = rows_of<Tiles>, WT = cols_of<Tiles>;
  constexpr int64_t column_ct = std::tuple_size_v<Columns>;
  const int64_t P = s.P(), Q = s.Q();
  // Row h sees the taps r in [max(0, h - P + 1), min(R - 1, h)], column v the taps t in
  // [max(0, v - Q + 1), min(S - 1, v)]: the interior columns, which see all S, go in tiles of
  // WT columns, the border columns one at a time.
  const int64_t in_lo = s.S - 1;
  int64_t in_hi = std::max(in_lo, Q);  // interior columns [in_lo, in_hi)
  if (tail_columns) in_hi = in_lo + (in_hi - in_lo) / WT * WT;
  for (int64_t h = 0; h < s.H; ++h) {
    const int64_t r_lo = std::max<int64_t>(0, h - P + 1), r_hi = std::min<int64_t>(s.R - 1, h);
    for (int64_t v = 0; v < s.W; ++v) {
      if (v == in_lo && in_hi > in_lo) {
        for (int64_t w0 = in_lo; w0 < in_hi; w0 += WT) {
          const int64_t nw = std::min<int64_t>(WT, in_hi - w0);
          for (int64_t c0 = 0; c0 < s.C; c0 += CT) {
            const int64_t nc = std::min<int64_t>(CT, s.C - c0);
            tiles[static_cast<size_t>(nc - 1)][static_cast<size_t>(nw - 1)](s, w, dy, h, r_lo,
                                                                            r_hi, w0, c0, dxT);
          }
        }
        v = in_hi - 1;
        continue;
      }
      const int64_t t_lo = std::max<int64_t>(0, v - Q + 1), t_hi = std::min<int64_t>(s.S - 1, v);
      for (int64_t c0 = 0; c0 < s.C; c0 += column_ct) {
        const int64_t nc = std::min<int64_t>(column_ct, s.C - c0);
        columns[static_cast<size_t>(nc - 1)](s, w, dy, h, r_lo, r_hi, v, t_lo, t_hi, c0, dxT);
      }
    }
  }
}

// ---- lanes_bf16.cpp: the lane blocks' bfloat16 products (precision bf16) ----
// The lane convolutions with vdpbf16ps's pair products (or their float32-FMA emulation, the same
// bits), for precision bf16. Weights are packed once per call into the calling thread's scratch
// (valid until its next call of the same function): words where hardware_dot (vdpbf16ps) is set,
// floats elsewhere; the passes take the same hardware_dot. xT (C, H, W, 16) and dyT (K, P, Q, 16)
// are lanes of values already rounded to bfloat16 (ops/bf16_round.h); w is rounded as packed.
struct LanesBf16Weights {
  const uint32_t* words;
  const float* floats;
};
LanesBf16Weights lanes_bf16_forward_weights(const Conv2dShape& s, const float* w,
                                            bool hardware_dot);
LanesBf16Weights lanes_bf16_dx_weights(const Conv2dShape& s, const float* w, bool hardware_dot);
// One block: outT (K, P, Q, 16) = the products of xT with w.
void lanes_bf16_forward(const Conv2dShape& s, const float* xT, const LanesBf16Weights& wP,
                        float* outT, bool hardware_dot);
// One block: dw (K, C*R*S) from xT and dyT (xoff as lanes_dw's), and dxT (C, H, W, 16) unless
// null (wD then unused).
void lanes_bf16_backward(const Conv2dShape& s, const float* xT, const float* dyT,
                         const int64_t* xoff, const LanesBf16Weights& wD, float* dw, float* dxT,
                         bool hardware_dot);

// ---- conv2d_cpu.cpp: the shape's rule (direct, lanes or im2col + sgemm) for precision bf16 ----
// conv2d_forward_algo / conv2d_backward_algo under auto for a shape winograd_by_auto leaves to
// the rule, with x and dy rounded to bfloat16 (ops/bf16_round.h) in the blocks' copies of them
// (im2col's col, the lanes, a block's images), without whole-tensor copies; w is not rounded (the
// caller rounds it). The direct and im2col shapes give the bits of float32's pass on rounded
// copies of x and dy, db included; the lane shapes run lanes_bf16.cpp's pair products on the
// rounded lanes (hardware_dot: vdpbf16ps), and db is the sum of the rounded dy as elsewhere.
void rule_forward_bf16(const Conv2dShape& s, const float* x, const float* w, const float* b,
                       float* y, bool hardware_dot);
void rule_backward_bf16(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                        float* dx, float* dw, float* db, bool hardware_dot);

// ---- winograd.cpp: F(4x4, 3x3) for 3x3 stride-1 convs with pad <= 2 ----
bool winograd_fits(const Conv2dShape& s);
// True where MGPU_CONV_ALGO=auto runs shape s through Winograd F(4x4, 3x3) (conv2d_cpu.cpp's
// rule: 3x3 stride 1, enough channels and pixels); precision bf16 follows the same rule
// (bf16.h).
bool winograd_by_auto(const Conv2dShape& s);
// round_bf16 (precision bf16, bf16.h): x and dy are rounded to bfloat16 (ops/bf16_round.h) as
// the transforms read them, which gives the bits of the pass on rounded copies (db included);
// w is not (the caller rounds it).
void winograd_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                      float* y, bool round_bf16 = false);
// As conv2d_backward: dx and db may be null, dw may not.
void winograd_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db, bool round_bf16 = false);
// winograd_fused.cpp: y = conv(x, w) + b (b may be null) from U (36, K, C), the transformed
// weights, with the input and output transforms fused around the products, block by block.
void winograd_fused_forward(const Conv2dShape& s, const float* x, const float* U, const float* b,
                            float* y, bool round_bf16);

// ---- winograd_bf16.cpp: F(2x2, 3x3) with bfloat16 products (ops/bf16.h) ----
// True where bf16_conv2d_forward runs winograd_bf16_forward for shape s under algorithm algo:
// winograd, for every 3x3 stride-1 conv with pad <= 2; no other algorithm takes it (bf16.h,
// and winograd_bf16_chosen's measurements).
bool winograd_bf16_chosen(const Conv2dShape& s, ConvAlgo algo);
// y = conv(x, w) + b (b may be null) for a 3x3 stride-1 conv with pad <= 2.
void winograd_bf16_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                           float* y, bool hardware_dot);

// ---- winograd_dw.cpp: the weight and bias gradients of winograd_backward ----
// dw (K, C, 3, 3) and db (K; may be null) of a shape winograd_fits.
void winograd_dw(const Conv2dShape& s, const float* x, const float* dy, float* dw, float* db,
                 bool round_bf16);

// ---- relu_pool.cpp: bias + relu + average pooling of one plane, and its gradient ----
void bias_relu_pool_plane(const float* __restrict v, float bias, int64_t P, int64_t Q, int64_t pool,
                          uint8_t* __restrict mask, float* __restrict pooled,
                          float* __restrict acc);
void relu_pool_grad_plane(const uint8_t* __restrict mask, const float* __restrict dpooled,
                          int64_t P, int64_t Q, int64_t pool, float* __restrict dy,
                          float* __restrict up);

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
