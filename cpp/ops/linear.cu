// cpp/ops/linear.cu -- linear's CUDA kernel: our own shared-memory tiled sgemm, the matrix product
// wherever cuBLAS cannot run (the emulated build first). Executed on emulated GPUs against
// cpu::sgemm; compiled by nvcc for real GPUs.
#include "ops/launch.cuh"
#include "ops/linear.h"

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
  // 64 bits: the last tile's col0 + tx (and l0 + kTile) pass 2^31 for n (k) near it.
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  float acc = 0.0f;
  for (int64_t l0 = 0; l0 < k; l0 += kTile) {
    if (trans_a) {  // A stored (k, m): op(A)[i][l] = a[l * lda + i]
      const int64_t i = row0 + tx, l = l0 + ty;
      a_tile[tx][ty] = i < m && l < k ? a[l * lda + i] : 0.0f;
    } else {
      const int64_t i = row0 + ty, l = l0 + tx;
      a_tile[ty][tx] = i < m && l < k ? a[i * lda + l] : 0.0f;
    }
    if (trans_b) {  // B stored (n, k): op(B)[l][j] = b[j * ldb + l]
      const int64_t l = l0 + tx, j = col0 + ty;
      b_tile[tx][ty] = l < k && j < n ? b[j * ldb + l] : 0.0f;
    } else {
      const int64_t l = l0 + ty, j = col0 + tx;
      b_tile[ty][tx] = l < k && j < n ? b[l * ldb + j] : 0.0f;
    }
    __syncthreads();  // the tiles are complete
    for (int l = 0; l < kTile; ++l) acc += a_tile[ty][l] * b_tile[l][tx];
    __syncthreads();  // everyone is done with the tiles before they are overwritten
  }
  const int64_t i = row0 + ty, j = col0 + tx;
  if (i < m && j < n) {
    float* out = c + i * ldc + j;
    // beta == 0 must not read C: it may hold garbage or NaN (BLAS semantics).
    *out = beta == 0.0f ? alpha * acc : alpha * acc + beta * *out;
  }
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
  const dim3 grid(detail::grid_blocks(op, ni, kTile), detail::grid_blocks(op, mi, kTile));
  MGPU_LAUNCH(sgemm_kernel, grid, dim3(kTile, kTile), 0, stream)
  (trans_a, trans_b, mi, ni, ki, alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
   static_cast<int>(ldc));
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace mgpu::ops::cuda
