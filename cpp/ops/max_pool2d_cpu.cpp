// cpp/ops/max_pool2d_cpu.cpp -- max pooling forward and backward on the CPU, compiled once per
// instruction set (cpu_isa.h). x, dx (N, C, H, W); y, dy, indices (N, C, P, Q). Planes (one image,
// one channel) are independent, so they run in parallel in fixed chunks and need no atomics.
// Forward finds each window's winner in two passes: down the window's rows for every column at
// once (vectors across columns), then across the window's columns; the second pass breaks ties by
// row first, so the winner is the one a row-major scan of the window picks (see max_pool2d.h).
#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "ops/cpu_isa.h"
#include "ops/max_pool2d.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

constexpr int64_t kPlanesPerTask = 16;

// Columns per vector: a zmm register with AVX-512, a ymm with AVX2; each lane does the same
// comparisons on both paths, so they give the same bits.
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float VecF __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kWidth * sizeof(int32_t))));
typedef float VecFU __attribute__((vector_size(kWidth * sizeof(float)), aligned(4), may_alias));
typedef int32_t VecIU __attribute__((vector_size(kWidth * sizeof(int32_t)), aligned(4), may_alias));

// Per-thread column buffers (each column's best value and its row), grown once.
thread_local std::vector<float> tl_best;
thread_local std::vector<int32_t> tl_row;

template <class F>
void for_plane_chunks(int64_t planes, F&& fn) {
  parallel_for((planes + kPlanesPerTask - 1) / kPlanesPerTask, [&](int64_t task) {
    const int64_t first = task * kPlanesPerTask;
    fn(first, std::min(planes, first + kPlanesPerTask));
  });
}

// For every column w of the plane xp (width W): best[w] and row[w] = the value and row that win
// over rows [r0, r1), read top to bottom: a value wins if greater than the best so far or NaN.
void column_winners(const float* xp, int64_t W, int64_t r0, int64_t r1, float* best,
                    int32_t* row) {
  const float* x0 = xp + r0 * W;
  for (int64_t w = 0; w < W; ++w) {
    best[w] = x0[w];
    row[w] = static_cast<int32_t>(r0);
  }
  for (int64_t r = r0 + 1; r < r1; ++r) {
    const float* xr = xp + r * W;
    const VecI rv = VecI{} + static_cast<int32_t>(r);
    int64_t w = 0;
    for (; w + kWidth <= W; w += kWidth) {
      const VecF v = *reinterpret_cast<const VecFU*>(xr + w);
      const VecF b = *reinterpret_cast<const VecFU*>(best + w);
      const VecI take = (v > b) | (v != v);
      *reinterpret_cast<VecFU*>(best + w) = take ? v : b;
      *reinterpret_cast<VecIU*>(row + w) = take ? rv : *reinterpret_cast<const VecIU*>(row + w);
    }
    for (; w < W; ++w) {  // the columns past the last full vector
      const float v = xr[w];
      if (v > best[w] || v != v) {
        best[w] = v;
        row[w] = static_cast<int32_t>(r);
      }
    }
  }
}

}  // namespace

void max_pool2d_forward(const MaxPoolShape& s, const float* x, float* y, int32_t* indices) {
  const int64_t H = s.H, W = s.W, P = s.P(), Q = s.Q();
  for_plane_chunks(s.N * s.C, [&](int64_t first, int64_t last) {
    if (static_cast<int64_t>(tl_best.size()) < W) {
      tl_best.resize(static_cast<size_t>(W));
      tl_row.resize(static_cast<size_t>(W));
    }
    float* best = tl_best.data();
    int32_t* row = tl_row.data();
    for (int64_t plane = first; plane < last; ++plane) {
      const float* xp = x + plane * H * W;
      float* yp = y + plane * P * Q;
      int32_t* ip = indices ? indices + plane * P * Q : nullptr;
      for (int64_t p = 0; p < P; ++p) {
        // The window's rows clipped to the image: -inf padding never wins (every window holds
        // an element of the image, and an element wins over -inf or ties it first).
        const int64_t top = p * s.sh - s.ph;
        column_winners(xp, W, std::max<int64_t>(top, 0), std::min(top + s.kh, H), best, row);
        for (int64_t q = 0; q < Q; ++q) {
          const int64_t left = q * s.sw - s.pw;
          const int64_t c0 = std::max<int64_t>(left, 0), c1 = std::min(left + s.kw, W);
          float b = best[c0];
          int32_t br = row[c0];
          int64_t bc = c0;
          for (int64_t c = c0 + 1; c < c1; ++c) {
            // In row-major order, (row[c], c) comes after (br, bc) iff row[c] >= br (c > bc):
            // a NaN there is a later NaN and wins; a number wins only if greater, or equal and
            // earlier (a row above), and never against a NaN.
            const float a = best[c];
            const int32_t r = row[c];
            const bool take = a != a ? (b == b || r >= br) : (a > b || (a == b && r < br));
            if (take) {
              b = a;
              br = r;
              bc = c;
            }
          }
          yp[p * Q + q] = b;
          if (ip) ip[p * Q + q] = static_cast<int32_t>(br * W + bc);
        }
      }
    }
  });
}

void max_pool2d_backward(const MaxPoolShape& s, const int32_t* indices, const float* dy,
                         float* dx) {
  const int64_t HW = s.H * s.W, PQ = s.P() * s.Q();
  for_plane_chunks(s.N * s.C, [&](int64_t first, int64_t last) {
    for (int64_t plane = first; plane < last; ++plane) {
      const int32_t* ip = indices + plane * PQ;
      const float* dyp = dy + plane * PQ;
      float* dxp = dx + plane * HW;
      std::fill(dxp, dxp + HW, 0.0f);
      for (int64_t o = 0; o < PQ; ++o) {
        const int32_t i = ip[o];
        if (i >= 0 && i < HW) dxp[i] += dyp[o];
      }
    }
  });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
