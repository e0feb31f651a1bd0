// cpp/ops/linear.cu -- linear's CUDA kernels: our own shared-memory tiled sgemm (the matrix product
// wherever cuBLAS cannot run, the emulated build first), the bias gradient dy (n, m) -> db (m),
// argmax over x (n, m) -> (n) and the count of rows whose argmax is the label (accuracy). Executed
// on emulated GPUs against cpu::sgemm, cpu::bias_grad_rows and cpu::argmax_rows (correct_count
// against a host count over cpu::argmax_rows); compiled by nvcc for real GPUs, never run on one.
#include "ops/kernels_cuda_impl.cuh"

namespace mgpu::ops::cuda {

namespace {

using detail::ceil_div;

// ---- sgemm: C (m, n) = alpha op(A) (m, k) op(B) (k, n) + beta C, row-major ----
// A 16 x 16 block computes a 16 x 16 tile of C, stepping along k one 16 x 16 tile of op(A) and of
// op(B) at a time through shared memory. A transposed operand is loaded with threadIdx.x along its
// stored rows (so a warp reads consecutive floats) and written transposed into the tile; the extra
// column keeps those writes free of bank conflicts.
constexpr int kTile = 16;

__global__ void sgemm_kernel(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                             const float* __restrict__ a, int lda, const float* __restrict__ b,
                             int ldb, float beta, float* __restrict__ c, int ldc) {
  __shared__ float a_tile[kTile][kTile + 1];  // [row of op(A)][l]
  __shared__ float b_tile[kTile][kTile + 1];  // [l][column of op(B)]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  float acc = 0.0f;
  for (int l0 = 0; l0 < k; l0 += kTile) {
    if (trans_a) {  // A stored (k, m): op(A)[i][l] = a[l * lda + i]
      const int i = row0 + tx, l = l0 + ty;
      a_tile[tx][ty] = i < m && l < k ? a[l * lda + i] : 0.0f;
    } else {
      const int i = row0 + ty, l = l0 + tx;
      a_tile[ty][tx] = i < m && l < k ? a[i * lda + l] : 0.0f;
    }
    if (trans_b) {  // B stored (n, k): op(B)[l][j] = b[j * ldb + l]
      const int l = l0 + tx, j = col0 + ty;
      b_tile[tx][ty] = l < k && j < n ? b[j * ldb + l] : 0.0f;
    } else {
      const int l = l0 + ty, j = col0 + tx;
      b_tile[ty][tx] = l < k && j < n ? b[l * ldb + j] : 0.0f;
    }
    __syncthreads();  // the tiles are complete
    for (int l = 0; l < kTile; ++l) acc += a_tile[ty][l] * b_tile[l][tx];
    __syncthreads();  // everyone is done with the tiles before they are overwritten
  }
  const int i = row0 + ty, j = col0 + tx;
  if (i < m && j < n) {
    float* out = c + i * ldc + j;
    // beta == 0 must not read C: it may hold garbage or NaN (BLAS semantics).
    *out = beta == 0.0f ? alpha * acc : alpha * acc + beta * *out;
  }
}

// ---- bias gradient: db[j] = sum_i dy[i, j] ----
// Block: 32 columns x 8 row slices; slice t adds rows t, t + 8, ... in order, then slice 0 adds
// the 8 partial sums in slice order. Fixed order, no atomics.
constexpr int kBiasCols = 32;
constexpr int kBiasSlices = 8;

__global__ void bias_grad_kernel(int n, int m, const float* __restrict__ dy,
                                 float* __restrict__ db) {
  __shared__ float part[kBiasSlices][kBiasCols];
  const int j = blockIdx.x * kBiasCols + threadIdx.x;
  float sum = 0.0f;
  if (j < m) {
    for (int i = threadIdx.y; i < n; i += kBiasSlices) sum += dy[i * m + j];
  }
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();  // every slice's partial sum is in place
  if (threadIdx.y == 0 && j < m) {
    float total = part[0][threadIdx.x];
    for (int t = 1; t < kBiasSlices; ++t) total += part[t][threadIdx.x];
    db[j] = total;
  }
}

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
  for (int j = lane; j < m; j += kWarp) {
    if (beats(xr[j], j, best, top)) {
      best = xr[j];
      top = j;
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
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
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
  for (int row = warp; row < n; row += kCountWarps) {
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

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           cudaStream_t stream) {
  const char* op = "cuda::sgemm";
  if (m <= 0 || n <= 0) return;
  if (k < 0) k = 0;
  const int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  detail::require(lda >= a_cols && ldb >= b_cols && ldc >= n, op,
                  "row strides lda=" + std::to_string(lda) + ", ldb=" + std::to_string(ldb) +
                      ", ldc=" + std::to_string(ldc) +
                      " are smaller than the rows they step over (" + std::to_string(a_cols) +
                      ", " + std::to_string(b_cols) + ", " + std::to_string(n) + ")");
  using detail::as_int;
  const int mi = as_int(op, "m", m), ni = as_int(op, "n", n), ki = as_int(op, "k", k);
  // Offsets are int in the kernel: the last element of each operand must be addressable.
  as_int(op, "A's extent", (trans_a ? k : m) * lda);
  as_int(op, "B's extent", (trans_b ? n : k) * ldb);
  as_int(op, "C's extent", m * ldc);
  detail::require(m <= int64_t{65535} * kTile, op, "m must be at most 1048560 (a grid's y limit)");
  const dim3 grid(ceil_div(ni, kTile), ceil_div(mi, kTile));
  MGPU_LAUNCH(sgemm_kernel, grid, dim3(kTile, kTile), 0, stream)
  (trans_a, trans_b, mi, ni, ki, alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
   static_cast<int>(ldc));
  MGPU_CUDA_CHECK_LAUNCH();
}

void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db, cudaStream_t stream) {
  const char* op = "cuda::bias_grad_rows";
  if (m <= 0) return;
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  MGPU_LAUNCH(bias_grad_kernel, ceil_div(mi, kBiasCols), dim3(kBiasCols, kBiasSlices), 0, stream)
  (ni, mi, dy, db);
  MGPU_CUDA_CHECK_LAUNCH();
}

void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out, cudaStream_t stream) {
  const char* op = "cuda::argmax_rows";
  detail::require(m >= 1, op, "needs m >= 1 columns");
  if (n <= 0) return;
  const int ni = detail::as_int(op, "n", n), mi = detail::as_int(op, "m", m);
  detail::as_int(op, "n*m", n * m);
  MGPU_LAUNCH(argmax_rows_kernel, ceil_div(ni, kRowsPerBlock), kRowsPerBlock * kWarp, 0, stream)
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
