// cpp/ops/linear.cpp -- validate, allocate, dispatch to sgemm: OpenBLAS on CPU devices; on GPUs
// cuBLAS in real CUDA builds, or our tiled kernel (emulated builds, MGPU_GEMM=native). bf16: the
// bf16 products (ops/bf16.h on CPUs, ops/bf16_gpu.h on GPUs, cuBLAS's bf16 GEMM where it runs).
#include "ops/linear.h"

#include <algorithm>

#include "core/gpu.h"
#include "core/parallel.h"
#include "ops/bf16.h"
#include "ops/bf16_gpu.h"
#include "ops/dispatch.h"
#include "ops/gemm.h"
#include "ops/vendor_gpu.h"

namespace mgpu::ops {

Tensor mm(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, Precision precision) {
  const char* op = "mm";
  require_dtype(op, "a", a, DType::F32);
  require_dtype(op, "b", b, DType::F32);
  require_same_device(op, {&a, &b});
  MGPU_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, op, ": both operands must be matrices (2 dims), "
                   "got shapes ", a.shape(), " and ", b.shape(),
                   a.dim() > 2 ? "; flatten a first, e.g. a.reshape(a.shape[0], -1)" : "");
  int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  int64_t k2 = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
  MGPU_CHECK_VALUE(k == k2, op, ": inner dimensions differ: ", a.shape(), trans_a ? "^T" : "",
                   " @ ", b.shape(), trans_b ? "^T" : "", " (", k, " vs ", k2, ")");
  Tensor y = Tensor::empty({m, n}, DType::F32, a.device());
  const float *ap = a.f32(), *bp = b.f32();
  float* yp = y.f32();
  const int64_t lda = a.size(1), ldb = b.size(1), a_rows = a.size(0), b_rows = b.size(0);
  const bool cublas = !a.device().is_cpu() && gemm_path() == GemmPath::Cublas;
  const bool bf16 = precision == Precision::BF16, dot = bf16 && cpu::bf16_hardware_dot();
  dispatch(a.device(), op,
           [=] {
             if (bf16) {
               cpu::bf16_mm(trans_a, trans_b, m, n, k, ap, lda, bp, ldb, yp, dot);
               return;
             }
             if (k == 0) {
               std::fill(yp, yp + m * n, 0.0f);
               return;
             }
             // Split the rows of y over the device's cores in fixed blocks; each block is an
             // independent product, so the result does not depend on the thread count.
             constexpr int64_t kRows = 64;
             parallel_for((m + kRows - 1) / kRows, [&](int64_t blk) {
               int64_t r0 = blk * kRows, rows = std::min(kRows, m - r0);
               const float* ablk = trans_a ? ap + r0 : ap + r0 * lda;
               cpu::sgemm(trans_a, trans_b, rows, n, k, 1.0f, ablk, lda, bp, ldb, 0.0f,
                          yp + r0 * n, n);
             });
           },
           [=, index = a.device().index](cudaStream_t stream) {
             if (m == 0 || n == 0) return;
             if (k == 0) {
               gpu::memset_async(index, yp, 0, static_cast<size_t>(m * n) * sizeof(float));
               return;
             }
             if constexpr (kCublas) {
               if (cublas && bf16) {
                 // cuBLAS reads bfloat16 operands from memory: a and b rounded into scratch.
                 GpuScratch sa(index, static_cast<size_t>(a_rows * lda) * sizeof(uint16_t));
                 GpuScratch sb(index, static_cast<size_t>(b_rows * ldb) * sizeof(uint16_t));
                 auto* ra = static_cast<uint16_t*>(sa.ptr);
                 auto* rb = static_cast<uint16_t*>(sb.ptr);
                 cuda::bf16_round_operands(a_rows * lda, ap, ra, stream);
                 cuda::bf16_round_operands(b_rows * ldb, bp, rb, stream);
                 cuda::bf16_mm_cublas(cuda::cublas_handle(index), trans_a, trans_b, m, n, k, ra,
                                      lda, rb, ldb, yp, n);
                 return;
               }
               if (cublas) {
                 cuda::sgemm_cublas(cuda::cublas_handle(index), trans_a, trans_b, m, n, k, 1.0f,
                                    ap, lda, bp, ldb, 0.0f, yp, n);
                 return;
               }
             }
             if (bf16) {
               cuda::bf16_mm(trans_a, trans_b, m, n, k, ap, lda, bp, ldb, yp, stream);
               return;
             }
             cuda::sgemm(trans_a, trans_b, m, n, k, 1.0f, ap, lda, bp, ldb, 0.0f, yp, n, stream);
           },
           a, b, y);
  return y;
}

}  // namespace mgpu::ops
