// cpp/ops/conv2d_cpu/direct.cpp -- conv2d for few taps (C*R*S <= 16, stride 1, no padding:
// LeNet's conv1): output rows sixteen columns at a time straight from x, the taps' loads kept in
// registers; forward, dw/db, the fused relu-pool forward and its dy-on-the-fly backward.
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

// ---- Direct convolution for few taps ----
// With C*R*S taps <= kDirectMaxTaps, stride 1 and no padding, each output row is computed as
// kW lanes at a time straight from x: lane q of tap j = (c, r, t) reads x[c, p + r, q + t],
// so the taps of a row chunk are kTaps unaligned loads, kept in registers while every output
// channel is multiplied out. The chunks of a row start at 0, kW, 2 kW, ... and the last one at
// Q - kW, overlapping the one before: the overlap recomputes the same lanes with the same
// operations, and every load stays inside the row of x it starts in. Every output gets the same
// operations whatever kW, so both paths give the same bits; the path is taken for Q >= 16 on both.
// dw's sums run in 16-lane chunks on both paths (the AVX2 path as two halves).
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
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, last = Q - kW;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  for (int64_t p = 0; p < P; ++p) {
    const float* xp = x + p * s.W;
    for (int64_t q0 = 0;; q0 += kW) {
      if (q0 > last) q0 = last;
      V xv[kTaps];
      for (int j = 0; j < kTaps; ++j) xv[j] = loadw(xp + off[static_cast<size_t>(j)] + q0);
      float* o = out + p * Q + q0;
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        V acc = xv[0] * wk[0];
        for (int j = 1; j < kTaps; ++j) acc += xv[j] * wk[j];
        storew(o + k * PQ, acc);
      }
      if (q0 == last) break;
    }
  }
}

// One block of B images: dw (K, C*R*S) and, unless null, db (K) of the block, with dy's chunks
// from dy_chunk(k, i, p, q0) (16 lanes of image i, channel k, row p from column q0). Each sum runs
// in sixteen lanes over the block's (image, row, chunk) in order, then the lanes are added in a
// fixed tree. The last chunk of a row starts at Q - 16 like forward's, with the lanes the chunk
// before already counted set to zero. kS > 0 says the taps are one channel's rows of kS columns
// (C == 1, S == kS): tap j is then read at row j / kS, column j % kS, a row pointer plus a
// constant, instead of through kTaps offsets that do not fit the general registers (reloaded from
// the stack at every chunk).
template <int kTaps, int kS, class DyChunk>
void direct_dw_block(const Conv2dShape& s, const float* __restrict x, int64_t B,
                     const DyChunk& dy_chunk, float* __restrict dw, float* __restrict db) {
  const int64_t P = s.P(), Q = s.Q(), CHW = s.C * s.H * s.W;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  const int64_t full = Q / kLanes16 * kLanes16;  // columns covered by whole chunks
  const V zero = {};
  for (int64_t k = 0; k < s.K; ++k) {
    V part[kTaps + 1][kHalves];  // each half's sums (taps, then db), added lane by lane at the end
    for (int h = 0; h < kHalves; ++h) {  // the chunk's lanes [h * kW, (h + 1) * kW)
      const int64_t lo = h * kW;
      VI lane;
      for (int l = 0; l < kW; ++l) lane[l] = static_cast<int32_t>(lo + l);
      const VI keep_tail = lane >= static_cast<int32_t>(kLanes16 - (Q - full));
      V acc[kTaps] = {};
      V accb = {};
      for (int64_t i = 0; i < B; ++i) {
        for (int64_t p = 0; p < P; ++p) {
          const float* xp = x + i * CHW + p * s.W + lo;
          // Tap j's offset from xp: a constant per row of taps where kS > 0.
          auto tap = [&](int j) -> int64_t {
            if constexpr (kS > 0) {
              return (j / kS) * s.W + j % kS;
            } else {
              return off[static_cast<size_t>(j)];
            }
          };
          for (int64_t q0 = 0; q0 < full; q0 += kLanes16) {
            const V d = dy_chunk(k, i, p, q0 + lo);
            accb += d;
            for (int j = 0; j < kTaps; ++j) {
              acc[j] += d * loadw(xp + tap(j) + q0);
            }
          }
          if (full < Q) {
            const int64_t q0 = Q - kLanes16;
            const V d = keep_tail ? dy_chunk(k, i, p, q0 + lo) : zero;
            accb += d;
            const float* xq = xp + q0;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
            // Hides xq's value where kS > 0, so the loads below address the taps from it (row
            // offsets plus constants) instead of GCC hoisting kTaps offsets, which spill.
            if constexpr (kS > 0) asm("" : "+r"(xq));
#endif
            for (int j = 0; j < kTaps; ++j) acc[j] += d * loadw(xq + tap(j));
          }
        }
      }
      for (int j = 0; j < kTaps; ++j) part[j][h] = acc[j];
      part[kTaps][h] = accb;
    }
    for (int j = 0; j < kTaps; ++j) dw[k * kTaps + j] = sum16(part[j]);
    if (db) db[k] = sum16(part[kTaps]);
  }
}

// direct_dw_block for kTaps taps: on the AVX2 path, one channel's 3x3 taps (LeNet's conv1) by
// rows. (The AVX-512 path has the same general registers; its half as many chunks reload them
// half as often.)
template <int kTaps, class DyChunk>
void direct_dw(const Conv2dShape& s, const float* __restrict x, int64_t B, const DyChunk& dy_chunk,
               float* __restrict dw, float* __restrict db) {
  if constexpr (kW == 8 && kTaps == 9) {
    if (s.C == 1 && s.S == 3) return direct_dw_block<kTaps, 3>(s, x, B, dy_chunk, dw, db);
  }
  direct_dw_block<kTaps, 0>(s, x, B, dy_chunk, dw, db);
}

// direct_dw_block with dy (K, B*P*Q, image-major columns, rows ld floats apart).
template <int kTaps>
void direct_backward_block(const Conv2dShape& s, const float* __restrict x, int64_t B,
                           const float* __restrict dy, int64_t ld, float* __restrict dw,
                           float* __restrict db) {
  const int64_t PQ = s.P() * s.Q(), Q = s.Q();
  direct_dw<kTaps>(
      s, x, B,
      [&](int64_t k, int64_t i, int64_t p, int64_t q0) {
        return loadw(dy + k * ld + i * PQ + p * Q + q0);
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
  using T = Lanes<kW>;
  const int64_t P = s.P(), Q = s.Q(), Pp = P / 2, Qp = Q / 2;
  const V zero = {};
  direct_dw<kTaps>(
      s, x, B,
      [&](int64_t k, int64_t i, int64_t p, int64_t q0) {
        if (p >= 2 * Pp) return zero;
        const float* dp = dpooled + ((i * s.K + k) * Pp + p / 2) * Qp;
        V up;
        if (q0 % 2 == 0 && q0 + kW <= 2 * Qp) {
          up = T::twice(loadv<T::H>(dp + q0 / 2) * 0.25f);
        } else {
          for (int l = 0; l < kW; ++l) {
            const int64_t q = q0 + l;
            up[l] = q < 2 * Qp ? dp[q / 2] * 0.25f : 0.0f;
          }
        }
        const VI keep = widen_bytes<VI, VB>(mask + ((i * s.K + k) * P + p) * Q + q0) != 0;
        return keep ? up : zero;
      },
      dw, db);
}

// direct_forward_image fused with bias, relu and 2x2 average pooling (LeNet's first block): rows
// are computed in pairs, and each pair's chunk goes from registers to mask and pooled, with the
// operations of bias_relu_pool2_plane on the same sums, so the bits of the unfused chain. Chunks
// go as for_each_pool2_chunk says; an odd Q's last column and an odd P's last row (no window
// covers them) only get their mask.
// mask may be null. kS > 0 says the taps are one channel's kTaps / kS rows of kS columns (C == 1,
// S == kS): the pair's second row then reads the first row's taps one row down, so the chunk
// loads the (kTaps / kS + 1) * kS distinct vectors once instead of 2 * kTaps (12 instead of 18 for
// 3x3), which with the two sums and a weight fits the AVX2 path's 16 ymm registers. The same
// loads feed the same operations, so the same bits.
template <int kTaps, int kS>
void direct_relu_pool2_rows(const Conv2dShape& s, const float* __restrict x,
                            const float* __restrict w, const float* __restrict b,
                            uint8_t* __restrict mask, float* __restrict pooled) {
  using T = Lanes<kW>;
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q, Pp = P / 2, Qp = Q / 2;
  const std::array<int64_t, kTaps> off = tap_offsets<kTaps>(s);
  const V zero = {};
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
    for_each_pool2_chunk<kW>(Q, [&](int64_t q0) {
      // in[j] is tap j of the first row, in[j + kSecond] tap j of the second.
      constexpr int kSecond = kS > 0 ? kS : kTaps;
      V in[kTaps + kSecond];
      if constexpr (kS > 0) {
        for (int i = 0; i < kTaps + kS; ++i) in[i] = loadw(x0 + (i / kS) * s.W + i % kS + q0);
      } else {
        for (int j = 0; j < kTaps; ++j) {
          in[j] = loadw(x0 + off[static_cast<size_t>(j)] + q0);
          in[j + kTaps] = loadw(x1 + off[static_cast<size_t>(j)] + q0);
        }
      }
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        V acc0 = in[0] * wk[0], acc1 = in[kSecond] * wk[0];
        for (int j = 1; j < kTaps; ++j) {
          acc0 += in[j] * wk[j];
          acc1 += in[j + kSecond] * wk[j];
        }
        const float bias = b ? b[k] : 0.0f;
        const V y0 = acc0 + bias, y1 = acc1 + bias;
        const VI k0 = ~(y0 <= zero), k1 = ~(y1 <= zero);  // relu keeps NaN
        if (mask) {
          uint8_t* m0 = mask + k * PQ + 2 * pp * Q + q0;
          storev(m0, mask_bytes(k0 & 1));
          storev(m0 + Q, mask_bytes(k1 & 1));
        }
        const V sum = (k0 ? y0 : zero) + (k1 ? y1 : zero);
        storev(pooled + (k * Pp + pp) * Qp + q0 / 2, (T::evens(sum) + T::odds(sum)) * 0.25f);
      }
    });
    if (mask && Q % 2 == 1) {  // odd Q: the last column
      for (int64_t k = 0; k < s.K; ++k) {
        const float bias = b ? b[k] : 0.0f;
        mask[k * PQ + 2 * pp * Q + Q - 1] = !(sum_at(k, 2 * pp, Q - 1) + bias <= 0.0f);
        mask[k * PQ + (2 * pp + 1) * Q + Q - 1] = !(sum_at(k, 2 * pp + 1, Q - 1) + bias <= 0.0f);
      }
    }
  }
  if (mask && P % 2 == 1) {  // odd P: the last row, as direct_forward_image computes it
    const int64_t p = P - 1;
    for (int64_t q0 = 0;; q0 += kW) {
      if (q0 > Q - kW) q0 = Q - kW;
      V a[kTaps];
      for (int j = 0; j < kTaps; ++j) a[j] = loadw(x + p * s.W + off[static_cast<size_t>(j)] + q0);
      for (int64_t k = 0; k < s.K; ++k) {
        const float* wk = w + k * kTaps;
        V acc = a[0] * wk[0];
        for (int j = 1; j < kTaps; ++j) acc += a[j] * wk[j];
        const V y = acc + (b ? b[k] : 0.0f);
        storev(mask + k * PQ + p * Q + q0, mask_bytes(~(y <= zero) & 1));
      }
      if (q0 == Q - kW) break;
    }
  }
}

// The fused forward for kTaps taps: on the AVX2 path, one channel's 3x3 taps (LeNet's conv1)
// share their rows (direct_relu_pool2_rows); 18 tap vectors held for every output channel spill
// 16 ymm registers. The AVX-512 path's 32 zmm registers hold them.
template <int kTaps>
void direct_relu_pool2_image(const Conv2dShape& s, const float* __restrict x,
                             const float* __restrict w, const float* __restrict b,
                             uint8_t* __restrict mask, float* __restrict pooled) {
  if constexpr (kW == 8 && kTaps == 9) {
    if (s.C == 1 && s.S == 3) return direct_relu_pool2_rows<kTaps, 3>(s, x, w, b, mask, pooled);
  }
  direct_relu_pool2_rows<kTaps, 0>(s, x, w, b, mask, pooled);
}

constexpr auto kDirectForward =
    table_1_to<kDirectMaxTaps>([](auto n) { return &direct_forward_image<decltype(n)::value>; });
constexpr auto kDirectBackward =
    table_1_to<kDirectMaxTaps>([](auto n) { return &direct_backward_block<decltype(n)::value>; });
constexpr auto kDirectReluPool2 = table_1_to<kDirectMaxTaps>(
    [](auto n) { return &direct_relu_pool2_image<decltype(n)::value>; });
constexpr auto kDirectPool2Backward = table_1_to<kDirectMaxTaps>(
    [](auto n) { return &direct_pool2_backward_block<decltype(n)::value>; });

DirectForwardFn direct_forward_kernel(int64_t taps) {
  return kDirectForward[static_cast<size_t>(taps - 1)];
}
DirectBackwardFn direct_backward_kernel(int64_t taps) {
  return kDirectBackward[static_cast<size_t>(taps - 1)];
}
DirectReluPool2Fn direct_relu_pool2_kernel(int64_t taps) {
  return kDirectReluPool2[static_cast<size_t>(taps - 1)];
}
DirectPool2BackwardFn direct_pool2_backward_kernel(int64_t taps) {
  return kDirectPool2Backward[static_cast<size_t>(taps - 1)];
}

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

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
