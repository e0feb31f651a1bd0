// cpp/ops/conv2d_cpu.cpp -- conv2d forward and backward on the CPU (LeNet's two convolutions).
// x (N, C, H, W), w (K, C, R, S) seen as a (K, C*R*S) matrix, b (K), y and dy (N, K, P, Q).
// A block of B images is unfolded (im2col) into col (C*R*S, B*P*Q), so y = w * col,
// dw = dy * col^T and dcol = w^T * dy are single sgemm calls and dx = col2im(dcol); for wide
// patches backward unfolds into the transpose of col (im2col_rows), from which dw is faster.
// conv2d_relu_pool_* (LeNet's conv + relu + avg-pool blocks) share those block loops and apply
// relu and the pooling to each block's product, or build its dy, while it is in cache.
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "ops/gemm.h"
#include "ops/kernels_cpu.h"

namespace mgpu::ops::cpu {

namespace {

// Images per block: the unit of parallel work, and the unit of the batch sums in dw and db. Each
// block sums its images into its own slot and the slots are added in block order afterwards. The
// size is a constant, never derived from the thread count, so every thread count adds the same
// numbers in the same order and gives bitwise-equal results (shards that are multiples of it
// also keep their blocks when a batch is split across devices). 8 images of LeNet's conv2 make
// the products 648 columns wide, where OpenBLAS runs ~20% faster than one image at a time.
// Blocks of 4 (col then fits a core's L2) looked ~1 ms/step faster on 2 threads (noisy runs on a
// loaded machine; a forward-only block of 4 gained nothing), but changed
// the bits enough that test_distributed's 300-step 1-device vs 2-process comparison drifted past
// its tolerance, so the block stays at 8.
constexpr int64_t kBlock = 8;

// The shortest patch (C*R*S floats) for which backward builds dw from im2col_rows (see there).
constexpr int64_t kPatchRowsMin = 64;

// Elements per task when adding the dw slots together; any size gives the same result.
constexpr int64_t kReduceChunk = 4096;

// Per-thread scratch, grown once to the largest shape seen and then reused, so steady-state
// training never allocates here. Workers use col, mat and row; the calling thread holds the slots.
thread_local std::vector<float> tl_col, tl_mat, tl_row, tl_slots;

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

// The forward product, block by block: unfolds each block of B images, multiplies, and hands
// the block's (K, B*P*Q) product (image-major columns, ld = B*P*Q) to emit(out, ld, n0, B), which
// runs on the worker that computed it while the product is still in its cache.
template <class Emit>
void forward_blocks(const Conv2dShape& s, const float* x, const float* w, const Emit& emit) {
  const int64_t PQ = s.P() * s.Q(), CRS = s.C * s.R * s.S, CHW = s.C * s.H * s.W;
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
template <class Load>
void backward_blocks(const Conv2dShape& s, const float* x, const float* w, const Load& load,
                     float* dx, float* dw, float* db) {
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
  const int64_t blocks = (s.N + kBlock - 1) / kBlock;
  float* slots = scratch(tl_slots, (blocks - 1) * (KCRS + s.K));
  auto dw_slot = [&](int64_t blk) { return blk == 0 ? dw : slots + (blk - 1) * KCRS; };
  auto db_slot = [&](int64_t blk) {
    return blk == 0 ? db : slots + (blocks - 1) * KCRS + (blk - 1) * s.K;
  };

  parallel_for(blocks, [&](int64_t blk) {
    const int64_t n0 = blk * kBlock, B = std::min(s.N - n0, kBlock), ld = B * PQ;
    float* col = scratch(tl_col, CRS * ld);  // col (or its transpose), then reused for dcol
    float* dyb = scratch(tl_mat, s.K * ld);  // dy of the block as (K, B*P*Q)
    load(dyb, ld, n0, B);
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

// One plane of the fused forward: with y = v + bias (P, Q), mask = (y > 0) and pooled =
// avg_pool(relu(y)) over pool x pool windows with stride pool (Pp, Qp). The sums run in
// avg_pool2d_forward's order (the window's rows first, then its columns), so the bits equal
// relu_forward then avg_pool2d_forward. mask may be null; acc holds Q floats.
void bias_relu_pool_plane(const float* __restrict v, float bias, int64_t P, int64_t Q, int64_t pool,
                          uint8_t* __restrict mask, float* __restrict pooled,
                          float* __restrict acc) {
  const int64_t Pp = P / pool, Qp = Q / pool;
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
  backward_blocks(s, x, w, load, dx, dw, db);
}

}  // namespace mgpu::ops::cpu
