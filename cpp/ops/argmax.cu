// cpp/ops/argmax.cu -- argmax over x (n, m) -> (n), one warp per row, and the count of rows whose
// argmax is the label (accuracy). Executed on emulated GPUs against cpu::argmax_rows (correct_count
// against a host count over it); compiled by nvcc for real GPUs.
#include "ops/argmax.h"
#include "ops/launch.cuh"

namespace mgpu::ops::cuda {

namespace {

using detail::ceil_div;

// ---- argmax: one warp per row ----
// Candidate (v, j), j < 0 for none. The order: any candidate beats none; NaN beats numbers (NumPy:
// the first NaN is the maximum); otherwise the larger value; on a tie (or two NaNs) the smaller
// column. A strict total order, so lanes may scan and combine in any grouping and agree with the
// CPU's left-to-right scan.
constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;

__device__ inline bool is_nan(float v) { return v != v; }

__device__ inline bool beats(float v, int j, float w, int i) {
  if (i < 0) return j >= 0;
  if (j < 0) return false;
  if (is_nan(v) || is_nan(w)) return is_nan(v) && (!is_nan(w) || j < i);
  return v > w || (v == w && j < i);
}

// The column of row xr's maximum, in every lane of the calling warp (all 32 lanes must call).
__device__ int row_argmax(const float* __restrict__ xr, int m, int lane) {
  float best = 0.0f;
  int top = -1;
  for (int64_t j = lane; j < m; j += kWarp) {  // 64 bits: j + kWarp passes 2^31 for m near it
    if (beats(xr[j], static_cast<int>(j), best, top)) {
      best = xr[j];
      top = static_cast<int>(j);
    }
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_top = __shfl_xor_sync(0xffffffffu, top, offset);
    if (beats(other, other_top, best, top)) {
      best = other;
      top = other_top;
    }
  }
  return top;
}

__global__ void argmax_rows_kernel(int n, int m, const float* __restrict__ x,
                                   int64_t* __restrict__ out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= n) return;  // the whole warp leaves together: the shuffles see full warps
  const int top = row_argmax(x + row * m, m, lane);
  if (lane == 0) out[row] = top;
}

// ---- correct count: rows whose argmax equals the label ----
// One block of kCountWarps warps: warp w takes rows w, w + kCountWarps, ... (row_argmax above),
// its lane 0 counting the hits; then thread 0 adds the warps' counts in warp order. A single
// block, so no second pass and no atomics: an evaluation batch is thousands of rows.
constexpr int kCountWarps = 8;

template <class Label>
__global__ void correct_count_kernel(int n, int m, const float* __restrict__ logits,
                                     const Label* __restrict__ labels, float* __restrict__ out) {
  __shared__ int hits[kCountWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int count = 0;
  // Every lane of a warp runs the same rows, so the shuffles in row_argmax see full warps.
  for (int64_t row = warp; row < n; row += kCountWarps) {
    const int top = row_argmax(logits + row * m, m, lane);
    // Compared as int64: a label of 2^32 + top must not match after truncation.
    count += static_cast<int64_t>(labels[row]) == top ? 1 : 0;
  }
  if (lane == 0) hits[warp] = count;
  __syncthreads();  // every warp's count is in place
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < kCountWarps; ++w) total += hits[w];
    *out = static_cast<float>(total);
  }
}

template <class Label>
void correct_count_impl(int64_t n, int64_t m, const float* logits, const Label* labels,
                        float* out, cudaStream_t stream) {
  const char* op = "cuda::correct_count";
  const int ni = detail::as_int(op, "n", n);
  detail::require(n == 0 || m >= 1, op, "needs m >= 1 columns");
  const int mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  // Launched for n == 0 too: the kernel writes the 0.
  auto* kernel = correct_count_kernel<Label>;
  MGPU_LAUNCH(kernel, 1, kCountWarps * kWarp, 0, stream)(ni, mi, logits, labels, out);
  MGPU_CUDA_CHECK_LAUNCH();
}
}  // namespace

void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out, cudaStream_t stream) {
  const char* op = "cuda::argmax_rows";
  detail::require(m >= 1, op, "needs m >= 1 columns");
  if (n <= 0) return;
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  MGPU_LAUNCH(argmax_rows_kernel, detail::grid_blocks(op, ni, kRowsPerBlock), kRowsPerBlock * kWarp,
              0, stream)
  (ni, mi, x, out);
  MGPU_CUDA_CHECK_LAUNCH();
}

void correct_count(int64_t n, int64_t m, const float* logits, const int64_t* labels, float* out,
                   cudaStream_t stream) {
  correct_count_impl(n, m, logits, labels, out, stream);
}
void correct_count(int64_t n, int64_t m, const float* logits, const int32_t* labels, float* out,
                   cudaStream_t stream) {
  correct_count_impl(n, m, logits, labels, out, stream);
}

}  // namespace mgpu::ops::cuda
