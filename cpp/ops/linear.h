// cpp/ops/linear.h -- matrix products: y = op(a) @ op(b), op transposing when asked.
// a (M, K), b (K, N), y (M, N) (before transposition). The chapter's dense layers are
// mm(h, W) + b; their backward is da = dy @ b^T and db = a^T @ dy, the same op transposed.
// Kernels: cpu::sgemm (gemm.h, a BLAS), linear.cu (our tiled kernel), linear_cublas.cu (cuBLAS).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"
#include "ops/precision.h"

struct cublasContext;  // cublasHandle_t

namespace mgpu::ops {

// precision BF16: bfloat16 operands, float32 sums (ops/bf16.h; on GPUs ops/bf16_gpu.h).
Tensor mm(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false,
          Precision precision = Precision::F32);

namespace cuda {
// Row-major C = alpha op(A) op(B) + beta C, exactly cpu::sgemm's contract (gemm.h): op(A) (m, k),
// op(B) (k, n), row strides lda, ldb, ldc; beta == 0 never reads C; m or n == 0 is a no-op.
// Our own 16 x 16 shared-memory tiled kernel: the matrix product of the emulated build (where
// cuBLAS cannot run) and of MGPU_GEMM=native. Throws std::invalid_argument if a row stride is
// smaller than its row.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           cudaStream_t stream);
// The same contract through cublasSgemm on the handle's stream (the caller binds handle and
// stream). Real CUDA builds only; no test runs it (cuBLAS cannot run on emulated GPUs).
void sgemm_cublas(cublasContext* handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                  int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float beta, float* c, int64_t ldc);
}  // namespace cuda

}  // namespace mgpu::ops
