// cpp/ops/linear_cublas.cu -- cuda::sgemm's contract (row-major, linear.h) through cuBLAS, the
// matrix product of real GPU builds (mm), and its bfloat16 form (bf16_gpu.h's bf16_mm_cublas). Real CUDA builds only: compiled and linked by nvcc; no
// test runs it (cuBLAS cannot run on emulated GPUs, which use our tiled kernel in linear.cu).
#include <cublas_v2.h>

#include <mutex>

#include "core/gpu.h"
#include "ops/bf16_gpu.h"
#include "ops/launch.cuh"
#include "ops/linear.h"
#include "ops/vendor_gpu.h"

namespace mgpu::ops::cuda {

cublasContext* cublas_handle(int device) {
  static std::mutex mutex;
  static cublasHandle_t handles[gpu::kMaxGpus] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (!handles[device]) {
    gpu::set_device(device);
    cublasHandle_t h = nullptr;
    cublasStatus_t status = cublasCreate(&h);
    if (status != CUBLAS_STATUS_SUCCESS) {
      throw ::mgpu::DeviceError("gpu(" + std::to_string(device) +
                                "): cublasCreate failed: " + cublasGetStatusString(status));
    }
    // Our own workspace, set after the stream (cublasSetStream resets it to the default pool):
    // gemms captured into train_batch's graphs then use fixed memory instead of adding
    // cudaMallocAsync/cudaFreeAsync nodes, and one workspace on one stream keeps results
    // bitwise reproducible. 32 MiB covers cuBLAS's recommendation up to Hopper. Never freed.
    constexpr size_t kWorkspaceBytes = size_t(32) << 20;
    void* workspace = nullptr;
    MGPU_CUDA_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
    const cublasStatus_t set[] = {
        cublasSetStream(h, gpu::compute_stream(device)),
        cublasSetWorkspace(h, workspace, kWorkspaceBytes),
        // Plain FP32 products (no TF32), so results match our kernels to float tolerance.
        cublasSetMathMode(h, CUBLAS_DEFAULT_MATH)};
    for (cublasStatus_t st : set) {
      if (st != CUBLAS_STATUS_SUCCESS) {
        throw ::mgpu::DeviceError("gpu(" + std::to_string(device) +
                                  "): configuring the cuBLAS handle failed: " +
                                  cublasGetStatusString(st));
      }
    }
    handles[device] = h;
  }
  return handles[device];
}

namespace {

void require_strides(const char* op, bool trans_a, bool trans_b, int64_t k, int64_t m, int64_t n,
                     int64_t lda, int64_t ldb, int64_t ldc) {
  const int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  detail::require(lda >= a_cols && ldb >= b_cols && ldc >= n, op,
                  "row strides lda=" + std::to_string(lda) + ", ldb=" + std::to_string(ldb) +
                      ", ldc=" + std::to_string(ldc) + " are smaller than the rows they step over");
}

void check(cublasStatus_t status, const char* op, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw ::mgpu::DeviceError(std::string(op) + ": " + call +
                              " failed: " + cublasGetStatusString(status));
  }
}

}  // namespace

void sgemm_cublas(cublasContext* handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                  int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float beta, float* c, int64_t ldc) {
  const char* op = "cuda::sgemm_cublas";
  if (m <= 0 || n <= 0) return;
  if (k < 0) k = 0;
  require_strides(op, trans_a, trans_b, k, m, n, lda, ldb, ldc);
  using detail::as_int;
  // cuBLAS is column-major. A row-major (r, c) matrix with row stride ld is the column-major
  // (c, r) matrix with leading dimension ld, its transpose: so row-major C = op(A) op(B) is
  // column-major C^T = op(B)^T op(A)^T, i.e. the same call with A and B swapped.
  // cuBLAS (like any BLAS) takes k == 0 as C = beta C and never reads C when beta == 0.
  const cublasStatus_t status =
      cublasSgemm(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                  as_int(op, "n", n), as_int(op, "m", m), as_int(op, "k", k), &alpha, b,
                  as_int(op, "ldb", ldb > 0 ? ldb : 1), a, as_int(op, "lda", lda > 0 ? lda : 1),
                  &beta, c, as_int(op, "ldc", ldc));
  check(status, op, "cublasSgemm");
}

void bf16_mm_cublas(cublasContext* handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                    int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                    float* c, int64_t ldc) {
  const char* op = "cuda::bf16_mm_cublas";
  if (m <= 0 || n <= 0) return;
  if (k < 0) k = 0;
  require_strides(op, trans_a, trans_b, k, m, n, lda, ldb, ldc);
  using detail::as_int;
  // Row-major as sgemm_cublas (A and B swapped for column-major cuBLAS): bfloat16 operands,
  // float32 output, float32 compute.
  const float one = 1.0f, zero = 0.0f;
  check(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                     trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, as_int(op, "n", n), as_int(op, "m", m),
                     as_int(op, "k", k), &one, b, CUDA_R_16BF,
                     as_int(op, "ldb", ldb > 0 ? ldb : 1), a, CUDA_R_16BF,
                     as_int(op, "lda", lda > 0 ? lda : 1), &zero, c, CUDA_R_32F,
                     as_int(op, "ldc", ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        op, "cublasGemmEx");
}

}  // namespace mgpu::ops::cuda
