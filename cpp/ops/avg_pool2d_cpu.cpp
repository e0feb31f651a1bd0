// cpp/ops/avg_pool2d_cpu.cpp -- average pooling forward and backward on the CPU (LeNet's two
// pools). x, dx (N, C, H, W); y, dy (N, C, P, Q), P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1; no
// padding. Planes (one image, one channel) are independent, so they run in parallel and need no
// atomics.
#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "ops/avg_pool2d.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

// Planes per parallel task: LeNet's are 26x26 and 9x9, too small to be a task each.
constexpr int64_t kPlanesPerTask = 16;

// Per-thread row buffer, grown once.
thread_local std::vector<float> tl_row;

float* scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

template <class F>
void for_plane_chunks(int64_t planes, F&& fn) {
  parallel_for((planes + kPlanesPerTask - 1) / kPlanesPerTask, [&](int64_t task) {
    const int64_t first = task * kPlanesPerTask;
    fn(first, std::min(planes, first + kPlanesPerTask));
  });
}

// The windows [lo, hi) along one axis that cover input index i (window o spans o*stride ..
// o*stride + kernel - 1, for o in [0, outputs)); empty where the floor dropped the tail.
struct Cover {
  int64_t lo, hi;
};
std::vector<Cover> covers(int64_t size, int64_t kernel, int64_t stride, int64_t outputs) {
  std::vector<Cover> out(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const int64_t first = i - kernel + 1;
    const int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
    const int64_t hi = std::min(outputs, i / stride + 1);
    out[static_cast<size_t>(i)] = {std::min(lo, hi), hi};
  }
  return out;
}

}  // namespace

void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y) {
  const int64_t P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1;
  const float area = static_cast<float>(kh * kw);
  for_plane_chunks(N * C, [&](int64_t first, int64_t last) {
    float* __restrict acc = scratch(tl_row, W);
    for (int64_t plane = first; plane < last; ++plane) {
      const float* xp = x + plane * H * W;
      float* __restrict yp = y + plane * P * Q;
      for (int64_t p = 0; p < P; ++p) {
        // Sum the window's kh rows first (contiguous, vectorized), then kw columns of that.
        const float* __restrict x0 = xp + p * sh * W;
        for (int64_t w = 0; w < W; ++w) acc[w] = x0[w];
        for (int64_t i = 1; i < kh; ++i) {
          const float* __restrict xi = x0 + i * W;
          for (int64_t w = 0; w < W; ++w) acc[w] += xi[w];
        }
        for (int64_t q = 0; q < Q; ++q) {
          const float* a = acc + q * sw;
          float sum = a[0];
          for (int64_t j = 1; j < kw; ++j) sum += a[j];
          yp[p * Q + q] = sum / area;
        }
      }
    }
  });
}

void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx) {
  const int64_t P = (H - kh) / sh + 1, Q = (W - kw) / sw + 1;
  const float area = static_cast<float>(kh * kw);
  if (kh == sh && kw == sw) {
    // Windows that tile without overlap (LeNet's 2x2, stride 2): every input lies in at most one
    // window, so dx is that window's dy / area -- the value the gather below computes, without
    // its per-element bookkeeping (which made this pass several times slower than the copy).
    for_plane_chunks(N * C, [&](int64_t first, int64_t last) {
      for (int64_t plane = first; plane < last; ++plane) {
        const float* dyp = dy + plane * P * Q;
        float* __restrict dxp = dx + plane * H * W;
        for (int64_t h = 0; h < H; ++h) {
          float* __restrict dxrow = dxp + h * W;
          if (h >= P * kh) {
            std::fill(dxrow, dxrow + W, 0.0f);
            continue;
          }
          const float* __restrict dyrow = dyp + (h / kh) * Q;
          for (int64_t q = 0; q < Q; ++q) {
            const float v = dyrow[q] / area;
            for (int64_t j = 0; j < kw; ++j) dxrow[q * kw + j] = v;
          }
          std::fill(dxrow + Q * kw, dxrow + W, 0.0f);
        }
      }
    });
    return;
  }
  const std::vector<Cover> row_cover = covers(H, kh, sh, P), col_cover = covers(W, kw, sw, Q);
  for_plane_chunks(N * C, [&](int64_t first, int64_t last) {
    float* __restrict acc = scratch(tl_row, Q);
    for (int64_t plane = first; plane < last; ++plane) {
      const float* dyp = dy + plane * P * Q;
      float* __restrict dxp = dx + plane * H * W;
      for (int64_t h = 0; h < H; ++h) {
        // Gather: the rows of dy whose windows cover h, summed in p order, then for each w the
        // columns whose windows cover it, in q order. Each dx element is written exactly once.
        const Cover rows = row_cover[static_cast<size_t>(h)];
        float* __restrict dxrow = dxp + h * W;
        if (rows.lo == rows.hi) {
          std::fill(dxrow, dxrow + W, 0.0f);
          continue;
        }
        const float* __restrict d0 = dyp + rows.lo * Q;
        for (int64_t q = 0; q < Q; ++q) acc[q] = d0[q];
        for (int64_t p = rows.lo + 1; p < rows.hi; ++p) {
          const float* __restrict dp = dyp + p * Q;
          for (int64_t q = 0; q < Q; ++q) acc[q] += dp[q];
        }
        for (int64_t w = 0; w < W; ++w) {
          const Cover cols = col_cover[static_cast<size_t>(w)];
          float sum = 0.0f;
          if (cols.lo < cols.hi) {
            sum = acc[cols.lo];
            for (int64_t q = cols.lo + 1; q < cols.hi; ++q) sum += acc[q];
          }
          dxrow[w] = sum / area;
        }
      }
    }
  });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
