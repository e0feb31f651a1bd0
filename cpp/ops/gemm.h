// cpp/ops/gemm.h -- single-precision matrix product for the CPU kernels (conv2d's im2col
// products, linear's matmul), through a CBLAS (OpenBLAS here). Row-major:
// C = alpha * op(A) * op(B) + beta * C, op(X) = X or X^T, with op(A) (m, k), op(B) (k, n),
// C (m, n); lda, ldb, ldc are row strides in floats.
#pragma once

#include <cstdint>
#include <string>

namespace mgpu::ops::cpu {

// BLAS semantics, including beta == 0 overwriting C without reading it (garbage or NaN in C is
// discarded). m == 0 or n == 0 is a no-op; k == 0 gives C = beta * C. Throws std::invalid_argument
// if a row stride is smaller than its row, std::length_error if a value does not fit the BLAS
// integer type (a BLAS would print and return instead). Calls blas_init_single_threaded() once.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// mgpu does its own threading (parallel_for over the device's share of cores); a BLAS that also
// spawned threads inside every call would oversubscribe the machine. Makes OpenBLAS
// single-threaded; a no-op with other BLAS vendors. Idempotent, cheap, callable from any thread.
void blas_init_single_threaded();

// Which BLAS this build calls (PyPI's or the system's) and its configuration string.
std::string blas_info();

}  // namespace mgpu::ops::cpu
