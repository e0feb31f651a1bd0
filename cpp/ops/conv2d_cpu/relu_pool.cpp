// cpp/ops/conv2d_cpu/relu_pool.cpp -- the fused conv-relu-pool's per-plane work: bias, relu's
// mask and average pooling of a conv product, and the backward's dy from mask and dpooled, with
// the bits of the unfused relu and avg_pool2d ops.
#include "ops/conv2d_cpu/conv2d_cpu.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv {

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
      // relu passes y where !(y <= 0): NaN passes, as in relu_forward.
      const typename T::I k0 = ~(a0 <= zero), k1 = ~(a1 <= zero);
      if (m0) {
        storev(m0 + q0, mask_bytes(k0 & 1));
        storev(m0 + Q + q0, mask_bytes(k1 & 1));
      }
      const F sum = (k0 ? a0 : zero) + (k1 ? a1 : zero);
      storev(out + q0 / 2, (T::evens(sum) + T::odds(sum)) * 0.25f);
    });
    if (m0 && Q % 2 == 1) {  // the column no window covers
      m0[Q - 1] = !(v0[Q - 1] + bias <= 0.0f);
      m0[2 * Q - 1] = !(v1[Q - 1] + bias <= 0.0f);
    }
  }
  if (mask) {  // the row no window covers
    for (int64_t j = 2 * Pp * Q; j < P * Q; ++j) mask[j] = !(v[j] + bias <= 0.0f);
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

// One plane of the fused forward: with y = v + bias (P, Q), mask = !(y <= 0) and pooled =
// avg_pool(relu(y)) over pool x pool windows with stride pool (Pp, Qp). relu keeps NaN (the
// mask is set for it), so a window holding a NaN pools to NaN, as the unfused ops give. The sums run in
// avg_pool2d_forward's order (the window's rows first, then its columns), so the bits equal
// relu_forward then avg_pool2d_forward. mask may be null; acc holds Q floats.
void bias_relu_pool_plane(const float* __restrict v, float bias, int64_t P, int64_t Q, int64_t pool,
                          uint8_t* __restrict mask, float* __restrict pooled,
                          float* __restrict acc) {
  const int64_t Pp = P / pool, Qp = Q / pool;
  // Chunks of 16 on the AVX-512 path, of 8 on the AVX2 path: the same operations per element.
#if defined(__AVX512F__)
  if (pool == 2 && 2 * Qp >= 16) return bias_relu_pool2_plane<16>(v, bias, P, Q, mask, pooled);
#endif
  if (pool == 2 && 2 * Qp >= 8) return bias_relu_pool2_plane<8>(v, bias, P, Q, mask, pooled);
  const DivideByArea divide(pool * pool);
  if (mask) {
    for (int64_t j = 0; j < P * Q; ++j) mask[j] = !(v[j] + bias <= 0.0f);
  }
  for (int64_t pp = 0; pp < Pp; ++pp) {
    const float* __restrict v0 = v + pp * pool * Q;
    float* __restrict out = pooled + pp * Qp;
    if (pool == 2) {  // LeNet's windows: the same sums, in loops of fixed shape that vectorize
      const float* __restrict v1 = v0 + Q;
      for (int64_t q = 0; q < 2 * Qp; ++q) {
        const float a0 = v0[q] + bias, a1 = v1[q] + bias;
        acc[q] = (!(a0 <= 0.0f) ? a0 : 0.0f) + (!(a1 <= 0.0f) ? a1 : 0.0f);
      }
      for (int64_t qq = 0; qq < Qp; ++qq) out[qq] = (acc[2 * qq] + acc[2 * qq + 1]) * 0.25f;
      continue;
    }
    for (int64_t q = 0; q < Q; ++q) {
      const float a = v0[q] + bias;
      acc[q] = !(a <= 0.0f) ? a : 0.0f;
    }
    for (int64_t i = 1; i < pool; ++i) {
      const float* __restrict vi = v0 + i * Q;
      for (int64_t q = 0; q < Q; ++q) {
        const float a = vi[q] + bias;
        acc[q] += !(a <= 0.0f) ? a : 0.0f;
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
#if defined(__AVX512F__)
  if (pool == 2 && 2 * Qp >= 16) return relu_pool2_grad_plane<16>(mask, dpooled, P, Q, dy);
#endif
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

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA::conv
