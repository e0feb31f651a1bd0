// cpp/ops/elementwise.cu -- elementwise.h's kernels: the per-element bodies (a op b for every
// BinaryOp, fills, the SGD and Adam steps, the clip factor) as grid-stride kernels, astype for
// every pair of float, int32, int64, uint8 and bfloat16, the sum of all elements, and
// sum_to_shape's row sums. Executed on emulated GPUs in tests
// (tests/cpp/emu_test_kernels_cuda.cpp); compiled by nvcc for real GPUs.
#include "ops/elementwise.h"
#include "ops/launch.cuh"

namespace mgpu::ops::cuda {

using detail::ceil_div;

template void for_each_index<FillOut>(int64_t, const FillOut&, cudaStream_t);
template void for_each_index<SgdStep>(int64_t, const SgdStep&, cudaStream_t);
template void for_each_index<AdamStep>(int64_t, const AdamStep&, cudaStream_t);
template void for_each_index<ClipFactor>(int64_t, const ClipFactor&, cudaStream_t);

#define MGPU_INSTANTIATE_BINARY(op)                                                         \
  template void for_each_index<BinaryOut<op>>(int64_t, const BinaryOut<op>&, cudaStream_t); \
  template void for_each_index<BinarySameOut<op>>(int64_t, const BinarySameOut<op>&,        \
                                                  cudaStream_t);                            \
  template void for_each_index<BinaryScalarOut<op>>(int64_t, const BinaryScalarOut<op>&,    \
                                                    cudaStream_t);
MGPU_INSTANTIATE_BINARY(BinaryOp::Add)
MGPU_INSTANTIATE_BINARY(BinaryOp::Sub)
MGPU_INSTANTIATE_BINARY(BinaryOp::Mul)
MGPU_INSTANTIATE_BINARY(BinaryOp::Div)
#undef MGPU_INSTANTIATE_BINARY

namespace {

// ---- astype: y[i] = To(x[i]) ----
template <class To, class From>
struct ConvertOut {
  const From* x; To* y;
  __host__ __device__ void operator()(int64_t i) const { y[i] = static_cast<To>(x[i]); }
};

// ---- sum of all elements ----
// One block: ops::sum serves losses and metrics of a batch (thousands of elements), where a second
// pass over per-block partials would cost more than it saves. Double partial sums, as the CPU
// accumulates: a float tree over 10^5 terms would drift visibly from the CPU's result.
constexpr int kSumThreads = 256;  // a power of two: the tree halves it down to 1

__global__ void sum_all_kernel(int n, const float* __restrict__ x, float* __restrict__ out) {
  __shared__ double part[kSumThreads];
  const int t = threadIdx.x;
  double acc = 0.0;
  for (int64_t i = t; i < n; i += kSumThreads) acc += x[i];  // consecutive threads, consecutive floats
  part[t] = acc;
  __syncthreads();  // every partial sum is in place
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (t < half) part[t] += part[t + half];
    __syncthreads();  // this level is complete before the next reads it
  }
  if (t == 0) *out = static_cast<float>(part[0]);
}

// ---- bias gradient: db[j] = sum_i dy[i, j] ----
// Block: 32 columns x 8 row slices; slice t adds rows t, t + 8, ... in order, then slice 0 adds
// the 8 partial sums in slice order. Fixed order, no atomics.
constexpr int kBiasCols = 32;
constexpr int kBiasSlices = 8;

__global__ void bias_grad_kernel(int n, int m, const float* __restrict__ dy,
                                 float* __restrict__ db) {
  __shared__ float part[kBiasSlices][kBiasCols];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kBiasCols + threadIdx.x;
  float sum = 0.0f;
  if (j < m) {
    for (int64_t i = threadIdx.y; i < n; i += kBiasSlices) sum += dy[i * m + j];
  }
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();  // every slice's partial sum is in place
  if (threadIdx.y == 0 && j < m) {
    float total = part[0][threadIdx.x];
    for (int t = 1; t < kBiasSlices; ++t) total += part[t][threadIdx.x];
    db[j] = total;
  }
}

}  // namespace

void sum_all(int64_t n, const float* x, float* out, cudaStream_t stream) {
  const int ni = detail::as_int("cuda::sum_all", "n", n);
  // Launched for n == 0 too: the kernel writes the 0.
  MGPU_LAUNCH(sum_all_kernel, 1, kSumThreads, 0, stream)(ni, x, out);
  MGPU_CUDA_CHECK_LAUNCH();
}

void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db, cudaStream_t stream) {
  const char* op = "cuda::bias_grad_rows";
  if (m <= 0) return;
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  MGPU_LAUNCH(bias_grad_kernel, detail::grid_blocks(op, mi, kBiasCols), dim3(kBiasCols, kBiasSlices),
              0, stream)
  (ni, mi, dy, db);
  MGPU_CUDA_CHECK_LAUNCH();
}

template <class To, class From>
void convert(int64_t n, const From* x, To* y, cudaStream_t stream) {
  for_each_index(n, ConvertOut<To, From>{x, y}, stream);
}

#define MGPU_INSTANTIATE_CONVERT(To)                                                \
  template void convert<To, float>(int64_t, const float*, To*, cudaStream_t);       \
  template void convert<To, int32_t>(int64_t, const int32_t*, To*, cudaStream_t);   \
  template void convert<To, int64_t>(int64_t, const int64_t*, To*, cudaStream_t);   \
  template void convert<To, uint8_t>(int64_t, const uint8_t*, To*, cudaStream_t);   \
  template void convert<To, BFloat16>(int64_t, const BFloat16*, To*, cudaStream_t);
MGPU_INSTANTIATE_CONVERT(float)
MGPU_INSTANTIATE_CONVERT(int32_t)
MGPU_INSTANTIATE_CONVERT(int64_t)
MGPU_INSTANTIATE_CONVERT(uint8_t)
MGPU_INSTANTIATE_CONVERT(BFloat16)
#undef MGPU_INSTANTIATE_CONVERT

}  // namespace mgpu::ops::cuda
