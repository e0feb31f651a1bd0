// cpp/ops/bf16.cu -- the bfloat16 products' CUDA kernels (ops/bf16_gpu.h): one thread per output,
// each summing in the CPU's order, so emulated GPUs, real ones and CPU devices give the same bits.
// Executed on emulated GPUs against the CPU kernels; compiled by nvcc for real GPUs.
#include <cfloat>

#include "ops/bf16_gpu.h"
#include "ops/launch.cuh"
#include "cuda/bf16.cuh"

namespace mgpu::ops::cuda {

namespace {

// A zero of v's sign where v is a float32 denormal (or zero), v otherwise: the CPU's DAZ on the
// operands and FTZ on the sums (v * 0.0f keeps the sign).
__host__ __device__ inline float flush(float v) {
  return v > -FLT_MIN && v < FLT_MIN ? v * 0.0f : v;
}

// acc plus one k pair's products: (a_even, a_odd) . (b_even, b_odd) as bfloat16 pairs, the odd
// element's product first, each an FMA flushed as vdpbf16ps flushes.
__device__ inline float pair_fma(float acc, float a_even, float a_odd, float b_even, float b_odd) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(flush(a_even), flush(a_odd));
  const __nv_bfloat162 b = __floats2bfloat162_rn(flush(b_even), flush(b_odd));
  acc = flush(fmaf(__high2float(a), __high2float(b), acc));
  return flush(fmaf(__low2float(a), __low2float(b), acc));
}

// acc plus sum over l in [0, k) of a(l) * b(l) in pairs (the last padded with zeros).
template <class A, class B>
__device__ inline float pair_dot(int64_t k, const A& a, const B& b, float acc) {
  for (int64_t l = 0; l < k; l += 2) {
    const bool odd = l + 1 < k;
    acc = pair_fma(acc, a(l), odd ? a(l + 1) : 0.0f, b(l), odd ? b(l + 1) : 0.0f);
  }
  return acc;
}

// ---- mm ----
struct MmBody {
  bool trans_a, trans_b;
  int64_t n, k;
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* c;
  __device__ void operator()(int64_t idx) const {
    const int64_t i = idx / n, j = idx % n;
    const float* ap = a;
    const float* bp = b;
    const int64_t sa = lda, sb = ldb;
    const bool ta = trans_a, tb = trans_b;
    const auto at = [=](int64_t l) { return ta ? ap[l * sa + i] : ap[i * sa + l]; };
    const auto bt = [=](int64_t l) { return tb ? bp[j * sb + l] : bp[l * sb + j]; };
    c[idx] = pair_dot(k, at, bt, 0.0f);
  }
};

// ---- conv2d ----
// Conv2dShape with its output extents, for device code (Conv2dShape's P() and Q() are host-only).
struct Geom {
  int64_t N, C, H, W, K, R, S, stride, pad, P, Q;
  explicit Geom(const Conv2dShape& s)
      : N(s.N), C(s.C), H(s.H), W(s.W), K(s.K), R(s.R), S(s.S), stride(s.stride), pad(s.pad),
        P(s.P()), Q(s.Q()) {}
};

// The input x (N, C, H, W) at image nn, channel c, padded position (h, v): zero outside.
__device__ inline float padded(const Geom& s, const float* x, int64_t nn, int64_t c,
                               int64_t h, int64_t v) {
  return h >= 0 && h < s.H && v >= 0 && v < s.W ? x[((nn * s.C + c) * s.H + h) * s.W + v] : 0.0f;
}

// y[nn, kk, p, q] = sum over (c, r, t) in order of W[kk, c, r, t] * x's patch value, plus bias.
struct ForwardBody {
  Geom s;
  const float *x, *w, *b;
  float* y;
  __device__ void operator()(int64_t idx) const {
    const int64_t P = s.P, Q = s.Q, RS = s.R * s.S;
    const int64_t q = idx % Q, p = idx / Q % P, kk = idx / (P * Q) % s.K, nn = idx / (P * Q * s.K);
    const Geom sh = s;
    const float* xp = x;
    const float* wk = w + kk * s.C * RS;
    const auto wt = [=](int64_t l) { return wk[l]; };
    const auto xt = [=, &sh](int64_t l) {
      const int64_t c = l / RS, r = l / sh.S % sh.R, t = l % sh.S;
      return padded(sh, xp, nn, c, p * sh.stride - sh.pad + r, q * sh.stride - sh.pad + t);
    };
    y[idx] = pair_dot(s.C * RS, wt, xt, 0.0f) + (b ? b[kk] : 0.0f);
  }
};

// dx[nn, c, h, v] = sum over (r, t) in order of dcol[(c, r, t), (nn, p, q)] for the output
// positions (p, q) that read it, each dcol = sum over k of W[k, c, r, t] * dy[nn, k, p, q]:
// the CPU's W^T @ dy followed by col2im, gathered per element (the shapes FlippedDataBody
// does not take: stride 2, pad > R-1).
struct DataBody {
  Geom s;
  const float *w, *dy;
  float* dx;
  __device__ void operator()(int64_t idx) const {
    const int64_t P = s.P, Q = s.Q, RS = s.R * s.S;
    const int64_t v = idx % s.W, h = idx / s.W % s.H, c = idx / (s.H * s.W) % s.C;
    const int64_t nn = idx / (s.H * s.W * s.C);
    const Geom sh = s;
    float out = 0.0f;
    for (int64_t r = 0; r < s.R; ++r) {
      const int64_t hp = h + s.pad - r;
      if (hp < 0 || hp % s.stride != 0 || hp / s.stride >= P) continue;
      const int64_t p = hp / s.stride;
      for (int64_t t = 0; t < s.S; ++t) {
        const int64_t vq = v + s.pad - t;
        if (vq < 0 || vq % s.stride != 0 || vq / s.stride >= Q) continue;
        const int64_t q = vq / s.stride;
        const float* wp = w + c * RS + r * s.S + t;
        const float* dyp = dy + nn * s.K * P * Q + p * Q + q;
        const int64_t wstride = s.C * RS, dystride = P * Q;
        const auto wt = [=](int64_t k) { return wp[k * wstride]; };
        const auto dyt = [=](int64_t k) { return dyp[k * dystride]; };
        out += pair_dot(sh.K, wt, dyt, 0.0f);
      }
    }
    dx[idx] = out;
  }
};

// dx for stride 1, a square kernel and pad <= R-1, as the CPU computes it: the forward pass of
// dy padded by R-1-pad with the kernel flipped in both axes and its channels swapped, one float32
// sum over (k, r, t) in order. t is that forward's shape (dy's extents in, x's out); w is read
// flipped in place (w[k, c, R-1-r, S-1-t]) rather than copied.
struct FlippedDataBody {
  Geom t;
  int64_t C;  // x's channels: w's second extent
  const float *w, *dy;
  float* dx;
  __device__ void operator()(int64_t idx) const {
    const int64_t P = t.P, Q = t.Q, R = t.R, S = t.S, RS = R * S;
    const int64_t q = idx % Q, p = idx / Q % P, c = idx / (P * Q) % t.K, nn = idx / (P * Q * t.K);
    const Geom sh = t;
    const float* wp = w;
    const float* dyp = dy;
    const int64_t xc = C;
    const auto wt = [=](int64_t l) {
      const int64_t k = l / RS, r = l / S % R, u = l % S;
      return wp[((k * xc + c) * R + (R - 1 - r)) * S + (S - 1 - u)];
    };
    const auto dyt = [=, &sh](int64_t l) {
      const int64_t k = l / RS, r = l / sh.S % sh.R, u = l % sh.S;
      return padded(sh, dyp, nn, k, p - sh.pad + r, q - sh.pad + u);
    };
    dx[idx] = pair_dot(t.C * RS, wt, dyt, 0.0f);
  }
};

// dw[kk, (c, r, t)] = sum over the chunks of `chunk` images, in order, of the chunk's
// dy[kk] . patch(c, r, t) over its columns (image, p, q), its pairs starting afresh.
struct WeightBody {
  Geom s;
  int64_t chunk;
  const float *x, *dy;
  float* dw;
  __device__ void operator()(int64_t idx) const {
    const int64_t P = s.P, Q = s.Q, PQ = P * Q, RS = s.R * s.S, CRS = s.C * RS;
    const int64_t kk = idx / CRS, l = idx % CRS;
    const int64_t c = l / RS, r = l / s.S % s.R, t = l % s.S;
    const Geom sh = s;
    const float* xp = x;
    float acc = 0.0f;
    for (int64_t n0 = 0; n0 < s.N; n0 += chunk) {
      const int64_t B = s.N - n0 < chunk ? s.N - n0 : chunk;
      const float* dyc = dy + (n0 * s.K + kk) * PQ;
      const int64_t kpq = s.K * PQ;
      const auto dyt = [=](int64_t col) { return dyc[col / PQ * kpq + col % PQ]; };
      const auto xt = [=, &sh](int64_t col) {
        const int64_t i = col / PQ, p = col % PQ / Q, q = col % Q;
        return padded(sh, xp, n0 + i, c, p * sh.stride - sh.pad + r, q * sh.stride - sh.pad + t);
      };
      acc = pair_dot(B * PQ, dyt, xt, acc);
    }
    dw[idx] = acc;
  }
};

// db[kk] = sum over images (in double) of each image's float32 sum of dy[n, kk] rounded to
// bfloat16 (the dy the products see).
struct BiasBody {
  Geom s;
  const float* dy;
  float* db;
  __device__ void operator()(int64_t kk) const {
    const int64_t PQ = s.P * s.Q;
    double total = 0.0;
    for (int64_t nn = 0; nn < s.N; ++nn) {
      const float* d = dy + (nn * s.K + kk) * PQ;
      float part = 0.0f;
      for (int64_t j = 0; j < PQ; ++j) part += __bfloat162float(__float2bfloat16_rn(flush(d[j])));
      total += part;
    }
    db[kk] = static_cast<float>(total);
  }
};

struct RoundBody {
  const float* x;
  uint16_t* out;
  __device__ void operator()(int64_t i) const {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(flush(x[i])));
  }
};

struct RoundTripBody {
  const float* x;
  float* out;
  __device__ void operator()(int64_t i) const {
    out[i] = __bfloat162float(__float2bfloat16_rn(flush(x[i])));
  }
};

struct WidenBody {
  const uint16_t* x;
  float* out;
  __device__ void operator()(int64_t i) const {
    out[i] = __bfloat162float(__ushort_as_bfloat16(x[i]));
  }
};

// Images per chunk of the CPU's conv passes (bf16_cpu.cpp's chunk_images): ~2048 product columns,
// between 1 and 64; dw's pairs restart at each chunk, so the GPU cuts the same chunks.
int64_t chunk_images(const Conv2dShape& s) {
  const int64_t pq = s.P() * s.Q(), want = (2048 + pq - 1) / pq;
  return want < 1 ? 1 : want > 64 ? 64 : want;
}

}  // namespace

void bf16_mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return;
  for_each_index(m * n, MmBody{trans_a, trans_b, n, k < 0 ? 0 : k, a, lda, b, ldb, c}, stream);
}

void bf16_conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, cudaStream_t stream) {
  for_each_index(s.N * s.K * s.P() * s.Q(), ForwardBody{Geom(s), x, w, b, y}, stream);
}

void bf16_conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, cudaStream_t stream) {
  detail::require(dw != nullptr, "cuda::bf16_conv2d_backward", "dw must not be null");
  if (db) for_each_index(s.K, BiasBody{Geom(s), dy, db}, stream);
  for_each_index(s.K * s.C * s.R * s.S, WeightBody{Geom(s), chunk_images(s), x, dy, dw}, stream);
  if (!dx) return;
  if (s.stride == 1 && s.R == s.S && s.pad <= s.R - 1) {  // bf16_cpu.cpp's dx_as_forward
    const Conv2dShape t{s.N, s.K, s.P(), s.Q(), s.C, s.R, s.S, 1, s.R - 1 - s.pad};
    for_each_index(s.N * s.C * s.H * s.W, FlippedDataBody{Geom(t), s.C, w, dy, dx}, stream);
  } else {
    for_each_index(s.N * s.C * s.H * s.W, DataBody{Geom(s), w, dy, dx}, stream);
  }
}

void bf16_round_operands(int64_t n, const float* x, uint16_t* out, cudaStream_t stream) {
  for_each_index(n, RoundBody{x, out}, stream);
}

void bf16_widen(int64_t n, const uint16_t* x, float* out, cudaStream_t stream) {
  for_each_index(n, WidenBody{x, out}, stream);
}

void bf16_round_to_float(int64_t n, const float* x, float* out, cudaStream_t stream) {
  for_each_index(n, RoundTripBody{x, out}, stream);
}

}  // namespace mgpu::ops::cuda
