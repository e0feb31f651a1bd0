// cpp/ops/conv2d.cu -- conv2d forward and backward as CUDA kernels with shared-memory tiles
// (LeNet's two convolutions, chapter 12.5). x, dx (N, C, H, W); w, dw (K, C, R, S); b, db (K); y,
// dy (N, K, P, Q); cross-correlation with one stride and zero padding on both axes. Executed on
// emulated GPUs against cpu::conv2d_* (tests/cpp/emu_test_kernels_cuda.cpp); compiled by nvcc for
// real GPUs.
#include "ops/launch.cuh"
#include "ops/conv2d.h"

namespace mgpu::ops::cuda {

namespace {

using detail::ceil_div;

// The shape in the kernels' int indexing, with P and Q (Conv2dShape's are host functions).
struct ConvDims {
  int N, C, H, W, K, R, S, stride, pad, P, Q;
};

// Every kernel's block is one 8 x 16 tile of an output plane (y, dx) or of the positions summed
// over (dw): 16 threads along a row, so a warp reads two runs of 16 consecutive floats.
constexpr int kTileRows = 8;
constexpr int kTileCols = 16;
constexpr int kThreads = kTileRows * kTileCols;
constexpr int kOutPerThread = 4;  // forward: output channels per block; dx: input channels
constexpr int kMaxSharedBytes = 48 * 1024;  // the default per-block limit on every GPU
constexpr int kMaxKernelTaps = 64;          // R * S bound of the weight-gradient kernel

// The input rows and columns a tile of outputs reads: the tile's span times stride, plus the
// kernel.
__host__ __device__ inline int patch_rows(const ConvDims& d) {
  return (kTileRows - 1) * d.stride + d.R;
}
__host__ __device__ inline int patch_cols(const ConvDims& d) {
  return (kTileCols - 1) * d.stride + d.S;
}

// Copies the zero-padded input patch of plane xc under the output tile at (p0, q0) into patch
// (patch_rows x patch_cols), all threads of the block taking every kThreads-th element.
__device__ void stage_input_patch(const ConvDims& d, const float* __restrict__ xc, int p0, int q0,
                                  float* __restrict__ patch, int tid) {
  const int rows = patch_rows(d), cols = patch_cols(d);
  const int h0 = p0 * d.stride - d.pad, w0 = q0 * d.stride - d.pad;
  for (int i = tid; i < rows * cols; i += kThreads) {
    const int h = h0 + i / cols, col = w0 + i % cols;
    patch[i] = h >= 0 && h < d.H && col >= 0 && col < d.W ? xc[h * d.W + col] : 0.0f;
  }
}

// ---- Forward: y[n, k, p, q] = b[k] + sum_{c, r, s} x[n, c, p*st - pad + r, q*st - pad + s] w[k,
// c, r, s] Grid: x = image * tiles + tile, y = groups of kOutPerThread output channels. Per input
// channel the block stages the input patch and those channels' R x S weights, then each thread adds
// its output's R * S products for every channel of the group: each staged value is used many times.
__global__ void conv2d_forward_kernel(ConvDims d, const float* __restrict__ x,
                                      const float* __restrict__ w, const float* __restrict__ b,
                                      float* __restrict__ y) {
  MGPU_DYNAMIC_SHARED(float, smem);
  const int taps = d.R * d.S, in_cols = patch_cols(d);
  float* patch = smem;
  float* wtile = smem + patch_rows(d) * in_cols;  // [kOutPerThread][R][S]

  const int tiles_q = ceil_div(d.Q, kTileCols), tiles = ceil_div(d.P, kTileRows) * tiles_q;
  const int n = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int p0 = tile / tiles_q * kTileRows, q0 = tile % tiles_q * kTileCols;
  const int p = p0 + threadIdx.y, q = q0 + threadIdx.x;
  const int k0 = blockIdx.y * kOutPerThread;
  const int tid = threadIdx.y * kTileCols + threadIdx.x;

  float acc[kOutPerThread] = {};
  for (int c = 0; c < d.C; ++c) {
    stage_input_patch(d, x + (n * d.C + c) * d.H * d.W, p0, q0, patch, tid);
    for (int i = tid; i < kOutPerThread * taps; i += kThreads) {
      const int k = k0 + i / taps;
      wtile[i] = k < d.K ? w[(k * d.C + c) * taps + i % taps] : 0.0f;
    }
    __syncthreads();  // the patch and weights are complete
    if (p < d.P && q < d.Q) {
      const float* at = patch + threadIdx.y * d.stride * in_cols + threadIdx.x * d.stride;
      for (int r = 0; r < d.R; ++r) {
        for (int s = 0; s < d.S; ++s) {
          const float v = at[r * in_cols + s];
          for (int j = 0; j < kOutPerThread; ++j) acc[j] += v * wtile[j * taps + r * d.S + s];
        }
      }
    }
    __syncthreads();  // everyone is done with them before the next channel overwrites them
  }
  if (p < d.P && q < d.Q) {
    for (int j = 0; j < kOutPerThread && k0 + j < d.K; ++j) {
      const int k = k0 + j;
      y[((n * d.K + k) * d.P + p) * d.Q + q] = acc[j] + (b != nullptr ? b[k] : 0.0f);
    }
  }
}

// ---- Input gradient, gather form: dx[n, c, h, w] = sum over k, r, s of dy[n, k, p, q] w[k, c, r,
// s] where h = p*st - pad + r and w = q*st - pad + s (p, q whole and in range). A block owns an 8 x
// 16 tile of dx for kOutPerThread input channels; per output channel k it stages the dy rows and
// columns that reach the tile, and w[k, c0.., :, :]. Each dx element is written once: no atomics.
// The dy patch: the p with p*st in [h0 + pad - R + 1, h0 + pad + kTileRows - 1], at most
// (kTileRows + R - 2) / st + 1 of them (and likewise for q).
__host__ __device__ inline int dy_patch_rows(const ConvDims& d) {
  return (kTileRows + d.R - 2) / d.stride + 1;
}
__host__ __device__ inline int dy_patch_cols(const ConvDims& d) {
  return (kTileCols + d.S - 2) / d.stride + 1;
}
// ceil(a / b) for b > 0 and any sign of a (C++ division truncates toward zero).
__device__ inline int ceil_div_signed(int a, int b) { return a >= 0 ? (a + b - 1) / b : -(-a / b); }

__global__ void conv2d_input_grad_kernel(ConvDims d, const float* __restrict__ w,
                                         const float* __restrict__ dy, float* __restrict__ dx) {
  MGPU_DYNAMIC_SHARED(float, smem);
  const int taps = d.R * d.S;
  const int dy_rows = dy_patch_rows(d), dy_cols = dy_patch_cols(d);
  float* dpatch = smem;                     // [dy_rows][dy_cols]
  float* wtile = smem + dy_rows * dy_cols;  // [kOutPerThread][R][S]

  const int tiles_w = ceil_div(d.W, kTileCols), tiles = ceil_div(d.H, kTileRows) * tiles_w;
  const int n = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int h0 = tile / tiles_w * kTileRows, w0 = tile % tiles_w * kTileCols;
  const int h = h0 + threadIdx.y, col = w0 + threadIdx.x;
  const int c0 = blockIdx.y * kOutPerThread;
  const int tid = threadIdx.y * kTileCols + threadIdx.x;
  const int p_lo = ceil_div_signed(h0 + d.pad - d.R + 1, d.stride);
  const int q_lo = ceil_div_signed(w0 + d.pad - d.S + 1, d.stride);

  float acc[kOutPerThread] = {};
  for (int k = 0; k < d.K; ++k) {
    const float* dyk = dy + (n * d.K + k) * d.P * d.Q;
    for (int i = tid; i < dy_rows * dy_cols; i += kThreads) {
      const int p = p_lo + i / dy_cols, q = q_lo + i % dy_cols;
      dpatch[i] = p >= 0 && p < d.P && q >= 0 && q < d.Q ? dyk[p * d.Q + q] : 0.0f;
    }
    for (int i = tid; i < kOutPerThread * taps; i += kThreads) {
      const int c = c0 + i / taps;
      wtile[i] = c < d.C ? w[(k * d.C + c) * taps + i % taps] : 0.0f;
    }
    __syncthreads();  // the dy patch and weights are complete
    if (h < d.H && col < d.W) {
      for (int r = 0; r < d.R; ++r) {
        const int ph = h + d.pad - r;  // = p * stride if row r of output row p read h
        if (ph < 0 || ph % d.stride != 0 || ph / d.stride >= d.P) continue;
        const float* drow = dpatch + (ph / d.stride - p_lo) * dy_cols;
        for (int s = 0; s < d.S; ++s) {
          const int qw = col + d.pad - s;
          if (qw < 0 || qw % d.stride != 0 || qw / d.stride >= d.Q) continue;
          const float g = drow[qw / d.stride - q_lo];
          for (int j = 0; j < kOutPerThread; ++j) acc[j] += g * wtile[j * taps + r * d.S + s];
        }
      }
    }
    __syncthreads();  // everyone is done with them before the next k overwrites them
  }
  if (h < d.H && col < d.W) {
    for (int j = 0; j < kOutPerThread && c0 + j < d.C; ++j) {
      dx[((n * d.C + c0 + j) * d.H + h) * d.W + col] = acc[j];
    }
  }
}

// ---- Weight (and bias) gradient: dw[k, c, r, s] = sum over n, p, q of
// dy[n, k, p, q] x[n, c, p*st - pad + r, q*st - pad + s]; db[k] = sum over n, p, q of dy[n, k, p,
// q]. Block (c, k) walks the images and the 8 x 16 tiles of the (P, Q) plane in order, staging the
// input patch under each tile; thread t adds, for its position in the tile, into its own column t
// of part[R*S + 1][kThreads] (the last row is db's). Then a tree of fixed shape adds the columns.
// The order of every addition is fixed by the shape alone: no atomics, reproducible bit for bit.
__global__ void conv2d_weight_grad_kernel(ConvDims d, const float* __restrict__ x,
                                          const float* __restrict__ dy, float* __restrict__ dw,
                                          float* __restrict__ db) {
  MGPU_DYNAMIC_SHARED(float, smem);
  const int taps = d.R * d.S, sums = taps + 1, in_cols = patch_cols(d);
  float* part = smem;                     // [sums][kThreads]
  float* patch = smem + sums * kThreads;  // [patch_rows][patch_cols]
  const int c = blockIdx.x, k = blockIdx.y;
  const int tid = threadIdx.y * kTileCols + threadIdx.x;

  for (int j = 0; j < sums; ++j) part[j * kThreads + tid] = 0.0f;
  __syncthreads();  // the tree reads every column, even when N == 0 leaves the loop unrun
  const int tiles_q = ceil_div(d.Q, kTileCols), tiles = ceil_div(d.P, kTileRows) * tiles_q;
  for (int n = 0; n < d.N; ++n) {
    const float* dyk = dy + (n * d.K + k) * d.P * d.Q;
    for (int tile = 0; tile < tiles; ++tile) {
      const int p0 = tile / tiles_q * kTileRows, q0 = tile % tiles_q * kTileCols;
      const int p = p0 + threadIdx.y, q = q0 + threadIdx.x;
      stage_input_patch(d, x + (n * d.C + c) * d.H * d.W, p0, q0, patch, tid);
      __syncthreads();  // the patch is complete
      if (p < d.P && q < d.Q) {
        const float g = dyk[p * d.Q + q];
        const float* at = patch + threadIdx.y * d.stride * in_cols + threadIdx.x * d.stride;
        for (int r = 0; r < d.R; ++r) {
          for (int s = 0; s < d.S; ++s)
            part[(r * d.S + s) * kThreads + tid] += g * at[r * in_cols + s];
        }
        part[taps * kThreads + tid] += g;
      }
      __syncthreads();  // everyone is done with the patch before the next tile overwrites it
    }
  }
  // Column t += column t + half, for half = 64, 32, ..., 1: every sum row at once.
  for (int half = kThreads / 2; half > 0; half /= 2) {
    for (int i = tid; i < sums * half; i += kThreads) {
      float* row = part + i / half * kThreads;
      row[i % half] += row[i % half + half];
    }
    __syncthreads();
  }
  for (int j = tid; j < taps; j += kThreads) dw[(k * d.C + c) * taps + j] = part[j * kThreads];
  if (tid == 0 && c == 0 && db != nullptr) db[k] = part[taps * kThreads];
}

ConvDims dims(const char* op, const Conv2dShape& s) {
  using detail::as_int;
  using detail::require;
  require(s.stride >= 1 && s.pad >= 0 && s.R >= 1 && s.S >= 1, op,
          "needs stride >= 1, pad >= 0 and a kernel of at least 1 x 1");
  require(s.P() >= 1 && s.Q() >= 1, op, "the kernel does not fit the padded image");
  ConvDims d{as_int(op, "N", s.N),   as_int(op, "C", s.C),           as_int(op, "H", s.H),
             as_int(op, "W", s.W),   as_int(op, "K", s.K),           as_int(op, "R", s.R),
             as_int(op, "S", s.S),   as_int(op, "stride", s.stride), as_int(op, "pad", s.pad),
             as_int(op, "P", s.P()), as_int(op, "Q", s.Q())};
  as_int(op, "x's element count N*C*H*W", s.N * s.C * s.H * s.W);
  as_int(op, "y's element count N*K*P*Q", s.N * s.K * s.P() * s.Q());
  as_int(op, "w's element count K*C*R*S", s.K * s.C * s.R * s.S);
  require(s.K <= 65535 && s.C <= 65535, op, "K and C must be at most 65535 (a grid's y limit)");
  return d;
}

size_t checked_shared(const char* op, int floats) {
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  detail::require(bytes <= static_cast<size_t>(kMaxSharedBytes), op,
                  "the tiles need " + std::to_string(bytes) +
                      " bytes of shared memory, more than the 48 KiB every GPU gives a block; "
                      "use a smaller kernel or stride");
  return bytes;
}

}  // namespace

void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b, float* y,
                    cudaStream_t stream) {
  const char* op = "cuda::conv2d_forward";
  const ConvDims d = dims(op, s);
  if (d.N == 0 || d.K == 0) return;
  const size_t shared =
      checked_shared(op, patch_rows(d) * patch_cols(d) + kOutPerThread * d.R * d.S);
  const int tiles = ceil_div(d.P, kTileRows) * ceil_div(d.Q, kTileCols);
  const dim3 grid(static_cast<unsigned>(tiles) * d.N, ceil_div(d.K, kOutPerThread));
  MGPU_LAUNCH(conv2d_forward_kernel, grid, dim3(kTileCols, kTileRows), shared, stream)
  (d, x, w, b, y);
  MGPU_CUDA_CHECK_LAUNCH();
}

void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db, cudaStream_t stream) {
  const char* op = "cuda::conv2d_backward";
  const ConvDims d = dims(op, s);
  detail::require(dw != nullptr, op, "dw must not be null (dx and db may be)");
  detail::require(d.R * d.S <= kMaxKernelTaps, op,
                  "the weight-gradient kernel supports R * S <= 64");
  if (dx != nullptr && d.N > 0 && d.C > 0) {
    const size_t shared =
        checked_shared(op, dy_patch_rows(d) * dy_patch_cols(d) + kOutPerThread * d.R * d.S);
    const int tiles = ceil_div(d.H, kTileRows) * ceil_div(d.W, kTileCols);
    const dim3 grid(static_cast<unsigned>(tiles) * d.N, ceil_div(d.C, kOutPerThread));
    MGPU_LAUNCH(conv2d_input_grad_kernel, grid, dim3(kTileCols, kTileRows), shared, stream)
    (d, w, dy, dx);
    MGPU_CUDA_CHECK_LAUNCH();
  }
  if (d.K > 0 && d.C > 0) {
    const size_t shared =
        checked_shared(op, (d.R * d.S + 1) * kThreads + patch_rows(d) * patch_cols(d));
    const dim3 grid(d.C, d.K);
    MGPU_LAUNCH(conv2d_weight_grad_kernel, grid, dim3(kTileCols, kTileRows), shared, stream)
    (d, x, dy, dw, db);
    MGPU_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace mgpu::ops::cuda
