// cpp/ops/batch_norm.cu -- batch norm's CUDA kernels: x, y, dy, dx (N, C, HW), per-channel arrays
// (C,). Reductions: a block per (chunk of a channel, channel) adds its elements in double into
// shared memory by a fixed tree, a second kernel adds each channel's chunk partials by another
// fixed tree (no atomics: bitwise reproducible). Per-element passes: a block row per (n, c) plane.
// Grid-stride loops with 64-bit indices. Executed on emulated GPUs against cpu::batch_norm_*.
#include "ops/batch_norm.h"
#include "ops/launch.cuh"

namespace mgpu::ops::cuda {

namespace {

constexpr int kReduceThreads = 256;  // a power of two: the tree halves it down to 1
// A chunk is at least this many elements (8 per thread), and a channel has at most kMaxChunks
// (a power of two: the finalize tree), so ResNet's 256x28x28 channels make 98 chunks.
constexpr int64_t kChunkElements = 2048;
constexpr int kMaxChunks = 128;
constexpr int kMaxGridY = 65535;

__device__ void tree_sum(double* a, double* b, int t, int width) {
  for (int half = width / 2; half > 0; half /= 2) {
    if (t < half) {
      a[t] += a[t + half];
      b[t] += b[t + half];
    }
    __syncthreads();  // this level is complete before the next reads it
  }
}

// partial[(c * chunks + chunk) * 2 + {0, 1}] = the chunk's two sums. Stats (kGrad false):
// sum(d), sum(d^2) with d = x - x[n=0, c, 0]; backward (kGrad true): sum(dy), sum(dy * (x - mean)).
// Thread t takes the chunk's elements t, t + blockDim, ... in order ((n, hw) order within the
// channel), stepping (n, hw) without a division per element.
template <bool kGrad>
__global__ void partial_sums_kernel(int64_t C, int64_t HW, int64_t count, int64_t chunk_len,
                                    int chunks, const float* __restrict__ x,
                                    const float* __restrict__ dy, const float* __restrict__ mean,
                                    double* __restrict__ partial) {
  __shared__ double s1[kReduceThreads];
  __shared__ double s2[kReduceThreads];
  const int t = threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk_len;
  const int64_t end = begin + chunk_len < count ? begin + chunk_len : count;
  const int64_t step_n = blockDim.x / HW, step_i = blockDim.x % HW;
  for (int64_t c = blockIdx.y; c < C; c += gridDim.y) {
    const double shift = kGrad ? static_cast<double>(mean[c]) : static_cast<double>(x[c * HW]);
    double a = 0.0, b = 0.0;
    int64_t j = begin + t;
    int64_t n = j / HW, i = j - n * HW;
    for (; j < end; j += blockDim.x) {
      const int64_t at = (n * C + c) * HW + i;
      const double d = static_cast<double>(x[at]) - shift;
      if (kGrad) {
        const double g = dy[at];
        a += g;
        b += g * d;
      } else {
        a += d;
        b += d * d;
      }
      n += step_n;
      i += step_i;
      if (i >= HW) {
        i -= HW;
        ++n;
      }
    }
    s1[t] = a;
    s2[t] = b;
    __syncthreads();  // every thread's sums are in place
    tree_sum(s1, s2, t, kReduceThreads);
    if (t == 0) {
      double* out = partial + (c * chunks + blockIdx.x) * 2;
      out[0] = s1[0];
      out[1] = s2[0];
    }
    __syncthreads();  // the next channel overwrites s1, s2 only after thread 0 has read them
  }
}

// Adds each channel's chunk partials (thread k takes chunk k, then a fixed tree) and writes the
// results: stats -> mean, var (biased); backward -> sum_dy, sum_dy_xhat.
template <bool kGrad>
__global__ void finalize_kernel(int64_t C, int64_t HW, int chunks, double count,
                                const float* __restrict__ x, const float* __restrict__ var,
                                float eps, const double* __restrict__ partial,
                                float* __restrict__ out1, float* __restrict__ out2) {
  __shared__ double s1[kMaxChunks];
  __shared__ double s2[kMaxChunks];
  const int t = threadIdx.x;
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    const double* in = partial + (c * chunks + t) * 2;
    s1[t] = t < chunks ? in[0] : 0.0;
    s2[t] = t < chunks ? in[1] : 0.0;
    __syncthreads();
    tree_sum(s1, s2, t, kMaxChunks);
    if (t == 0) {
      const double sum1 = s1[0], sum2 = s2[0];
      if (kGrad) {
        out1[c] = static_cast<float>(sum1);
        out2[c] = static_cast<float>(sum2 * static_cast<double>(1.0f / sqrtf(var[c] + eps)));
      } else {
        const double variance = (sum2 - sum1 * sum1 / count) / count;
        out1[c] = static_cast<float>(static_cast<double>(x[c * HW]) + sum1 / count);
        out2[c] = static_cast<float>(variance > 0.0 ? variance : 0.0);
      }
    }
    __syncthreads();
  }
}

// y = (x - mean) * (gamma * invstd) + beta, as cpu::batch_norm_forward computes it.
__global__ void forward_kernel(int64_t planes, int64_t C, int64_t HW, const float* __restrict__ x,
                               const float* __restrict__ mean, const float* __restrict__ var,
                               const float* __restrict__ gamma, const float* __restrict__ beta,
                               float eps, float* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t p = blockIdx.y; p < planes; p += gridDim.y) {
    const int64_t c = p % C;
    const float invstd = 1.0f / sqrtf(var[c] + eps);
    const float a = gamma ? gamma[c] * invstd : invstd, b = beta ? beta[c] : 0.0f;
    const float m = mean[c];
    const float* xp = x + p * HW;
    float* yp = y + p * HW;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < HW;
         i += stride) {
      yp[i] = (xp[i] - m) * a + b;
    }
  }
}

__global__ void backward_kernel(int64_t planes, int64_t C, int64_t HW,
                                const float* __restrict__ x, const float* __restrict__ dy,
                                const float* __restrict__ mean, const float* __restrict__ var,
                                const float* __restrict__ gamma, const float* __restrict__ sum_dy,
                                const float* __restrict__ sum_dy_xhat, double count, float eps,
                                bool training, float* __restrict__ dx) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t p = blockIdx.y; p < planes; p += gridDim.y) {
    const int64_t c = p % C;
    const float invstd = 1.0f / sqrtf(var[c] + eps);
    const float k = gamma ? gamma[c] * invstd : invstd;
    const float mean_dy = training ? static_cast<float>(sum_dy[c] / count) : 0.0f;
    const float coef =
        training ? static_cast<float>(sum_dy_xhat[c] * static_cast<double>(invstd) / count) : 0.0f;
    const float m = mean[c];
    const float* xp = x + p * HW;
    const float* dyp = dy + p * HW;
    float* dxp = dx + p * HW;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < HW;
         i += stride) {
      dxp[i] = training ? k * (dyp[i] - mean_dy - (xp[i] - m) * coef) : k * dyp[i];
    }
  }
}

void require_shape(const char* op, int64_t N, int64_t C, int64_t HW) {
  detail::require(N >= 0 && C >= 0 && HW >= 0, op, "N, C and HW must be >= 0");
}

// Launch shape of the per-element passes: a block row per plane, as many threads as HW needs (a
// multiple of 32, at most 256: 7x7 maps use 64), enough blocks along x to cover HW.
struct PlaneGrid {
  dim3 grid, block;
};
PlaneGrid plane_grid(int64_t planes, int64_t HW) {
  const int64_t threads = HW >= 256 ? 256 : (HW + 31) / 32 * 32;
  const int64_t gx = (HW + threads - 1) / threads;
  return {dim3(static_cast<unsigned>(gx < 64 ? gx : 64),
               static_cast<unsigned>(planes < kMaxGridY ? planes : kMaxGridY)),
          dim3(static_cast<unsigned>(threads))};
}

template <bool kGrad>
void reduce(const char* op, int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
            const float* mean, const float* var, float eps, float* out1, float* out2,
            void* workspace, cudaStream_t stream) {
  require_shape(op, N, C, HW);
  detail::require(N * HW >= 1 || C == 0, op, "needs at least one element per channel");
  if (C == 0) return;
  const int64_t count = N * HW;
  const int chunks = static_cast<int>(batch_norm_chunks(N, HW));
  const int64_t chunk_len = (count + chunks - 1) / chunks;
  double* partial = static_cast<double*>(workspace);
  auto* partial_kernel = partial_sums_kernel<kGrad>;
  const dim3 grid(static_cast<unsigned>(chunks),
                  static_cast<unsigned>(C < kMaxGridY ? C : kMaxGridY));
  MGPU_LAUNCH(partial_kernel, grid, kReduceThreads, 0, stream)(C, HW, count, chunk_len, chunks,
                                                               x, dy, mean, partial);
  MGPU_CUDA_CHECK_LAUNCH();
  auto* final_kernel = finalize_kernel<kGrad>;
  const int blocks = static_cast<int>(C < 4096 ? C : 4096);
  MGPU_LAUNCH(final_kernel, blocks, kMaxChunks, 0, stream)(C, HW, chunks,
                                                           static_cast<double>(count), x, var,
                                                           eps, partial, out1, out2);
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace

int64_t batch_norm_chunks(int64_t N, int64_t HW) {
  const int64_t wanted = (N * HW + kChunkElements - 1) / kChunkElements;
  return wanted < 1 ? 1 : wanted > kMaxChunks ? kMaxChunks : wanted;
}

size_t batch_norm_workspace_bytes(int64_t N, int64_t C, int64_t HW) {
  return static_cast<size_t>(C * batch_norm_chunks(N, HW)) * 2 * sizeof(double);
}

void batch_norm_stats(int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var,
                      void* workspace, cudaStream_t stream) {
  reduce<false>("cuda::batch_norm_stats", N, C, HW, x, nullptr, nullptr, nullptr, 0.0f, mean, var,
                workspace, stream);
}

void batch_norm_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                                const float* mean, const float* var, float eps, float* sum_dy,
                                float* sum_dy_xhat, void* workspace, cudaStream_t stream) {
  reduce<true>("cuda::batch_norm_backward_reduce", N, C, HW, x, dy, mean, var, eps, sum_dy,
               sum_dy_xhat, workspace, stream);
}

void batch_norm_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                        const float* var, const float* gamma, const float* beta, float eps,
                        float* y, cudaStream_t stream) {
  require_shape("cuda::batch_norm_forward", N, C, HW);
  if (N * C * HW == 0) return;
  const PlaneGrid g = plane_grid(N * C, HW);
  MGPU_LAUNCH(forward_kernel, g.grid, g.block, 0, stream)(N * C, C, HW, x, mean, var, gamma,
                                                          beta, eps, y);
  MGPU_CUDA_CHECK_LAUNCH();
}

void batch_norm_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                         const float* mean, const float* var, const float* gamma,
                         const float* sum_dy, const float* sum_dy_xhat, double count, float eps,
                         bool training, float* dx, cudaStream_t stream) {
  require_shape("cuda::batch_norm_backward", N, C, HW);
  if (N * C * HW == 0) return;
  const PlaneGrid g = plane_grid(N * C, HW);
  MGPU_LAUNCH(backward_kernel, g.grid, g.block, 0, stream)(N * C, C, HW, x, dy, mean, var, gamma,
                                                           sum_dy, sum_dy_xhat, count, eps,
                                                           training, dx);
  MGPU_CUDA_CHECK_LAUNCH();
}

template void for_each_index<BatchNormCombineStats>(int64_t, const BatchNormCombineStats&,
                                                   cudaStream_t);
template void for_each_index<BatchNormCombineSums>(int64_t, const BatchNormCombineSums&,
                                                  cudaStream_t);

}  // namespace mgpu::ops::cuda
