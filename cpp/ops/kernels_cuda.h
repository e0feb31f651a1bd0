// cpp/ops/kernels_cuda.h -- the raw CUDA kernels behind LeNet's ops (chapter 12.5), mirroring
// kernels_cpu.h: float32, NCHW contiguous, raw device pointers, no Tensor; callers (ops/*.cpp, the
// plumbing step) check shapes, allocate and pick the stream. Shapes, argument order and results are
// those of the cpu:: kernel of the same name (compared in tests/cpp/emu_test_kernels_cuda.cpp).
// Shape letters: N batch, C in-channels, K out-channels, H/W image, R/S kernel, P/Q output size.
//
// Every launcher enqueues on `stream` and returns without waiting; it throws std::invalid_argument
// for a shape it cannot launch (a precondition below) and, via MGPU_CUDA_CHECK, the launch error
// (emulated: also any failure inside the kernel). Kernels overwrite their outputs (sgemm's beta C
// and the in-place per-element bodies aside) and use no atomics for sums: every sum is added in a
// fixed order, so results are bitwise reproducible run to run (though not bitwise equal to the
// CPU's order). Element counts must fit in int32 (LeNet's largest tensor is far below; the
// per-element bodies use int64); launchers check.
//
// What has been executed: every kernel here, on emulated GPUs (cpp/emu/), against the cpu::
// kernels. What has only been compiled (nvcc, sm_75/80/90): the same sources for real GPUs, and the
// cuBLAS and cuDNN paths at the end of this file, which no test has ever run.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/kernels_cpu.h"  // cpu::Conv2dShape

// The CUDA runtime's and the emulator's stream type, declared the same way both do, so ops/*.cpp
// can include this header without the CUDA include path.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace mgpu::ops::cuda {

using Conv2dShape = cpu::Conv2dShape;

// ---- conv2d (conv2d.cu): x (N, C, H, W), w (K, C, R, S), b (K), y, dy (N, K, P, Q) ----
// Forward: y = conv(x, w) + b, b may be null. Shared-memory tiles: a block computes an 8 x 16 tile
// of y for 4 output channels of one image, staging the input patch and the weights of one input
// channel at a time.
void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b, float* y,
                    cudaStream_t stream);
// Backward writes dx, dw, db; dx and db may be null, dw may not. dx is the gather form: each dx
// element sums, over k then r then s, the dy elements it fed (a block stages a dy patch and w for 4
// input channels per k). dw[k, c] (and db[k], alongside the c == 0 blocks) is one block's sum over
// N, P, Q: each thread adds its positions in order, then a shared-memory tree of fixed shape adds
// the threads. Precondition: R * S <= 64 (the per-thread partial sums live in shared memory).
void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db, cudaStream_t stream);

// ---- avg_pool2d (avg_pool2d.cu): x, dx (N, C, H, W); y, dy (N, C, P, Q) ----
// As cpu::avg_pool2d_*: no padding, P = (H - kh) / sh + 1. One thread per output element, adding
// in cpu::'s order; backward is the gather form (each dx element sums dy over the windows that
// cover it; no atomics).
void avg_pool2d_forward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                        int64_t sh, int64_t sw, const float* x, float* y, cudaStream_t stream);
void avg_pool2d_backward(int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw,
                         int64_t sh, int64_t sw, const float* dy, float* dx, cudaStream_t stream);

// ---- softmax cross-entropy (softmax_ce.cu): logits, dlogits (n, m); labels, loss, dloss (n) ----
// One warp per row: max and logsumexp fused (loss = z_top - z_label + log1p(sum_{j != top}
// exp(z_j - z_top)), as on the CPU). The labels live on the device, so they cannot be checked
// before the launch: a label outside [0, m) is never used as an index; its row gets loss NaN
// (backward: a NaN row of dlogits), and if bad_row is not null the launcher first sets *bad_row to
// kNoBadRow and the kernel lowers it to the smallest such row (atomicMin: a flag, not a sum). The
// caller reads *bad_row at its next synchronisation and raises the error cpu:: would have raised
// (std::out_of_range naming label, row and m) -- see check_bad_row below.
constexpr int32_t kNoBadRow = 0x7f7f7f7f;  // the int32 whose bytes are all 0x7f (a memset value)
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row, cudaStream_t stream);
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits, int32_t* bad_row, cudaStream_t stream);
// Host side, after synchronising: throws std::out_of_range in cpu::'s words if bad_row_value (the
// downloaded *bad_row) names a row; `label` is that row's label, downloaded by the caller.
void check_bad_row(const char* op, int32_t bad_row_value, int64_t label, int64_t m);

// ---- linear (linear.cu) ----
// argmax over x (n, m) -> out (n): first maximum wins ties, the first NaN counts as the maximum.
// One warp per row. Precondition: m >= 1.
void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out, cudaStream_t stream);
// *out = the number of rows i of logits (n, m) whose argmax (argmax_rows's rule) equals labels[i],
// as a float (ops::correct_count's 0-d result); n == 0 gives 0. A label outside [0, m) never
// matches (compared as int64, never used as an index). One block: a warp per row as in
// argmax_rows, each warp counting its hits, then the warps' counts added in warp order (integers:
// exact and reproducible). Precondition: m >= 1 when n > 0.
void correct_count(int64_t n, int64_t m, const float* logits, const int64_t* labels, float* out,
                   cudaStream_t stream);
void correct_count(int64_t n, int64_t m, const float* logits, const int32_t* labels, float* out,
                   cudaStream_t stream);
// db[j] = sum_i dy[i, j] over dy (n, m): a block of 32 columns x 8 row slices, slices added in
// order.
void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db, cudaStream_t stream);
// Row-major C = alpha op(A) op(B) + beta C, exactly cpu::sgemm's contract (gemm.h): op(A) (m, k),
// op(B) (k, n), row strides lda, ldb, ldc; beta == 0 never reads C; m or n == 0 is a no-op.
// Our own 16 x 16 shared-memory tiled kernel: the matrix product of the emulated build (where
// cuBLAS cannot run) and of builds without cuBLAS. Throws std::invalid_argument if a row stride
// is smaller than its row.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           cudaStream_t stream);

// ---- per-element bodies (relu.cu, elementwise.cu; the bodies live in relu.h, elementwise.h) ----
// body(i) for i in [0, n) as a grid-stride kernel on `stream`, then a launch check. Defined in
// kernels_cuda_impl.cuh and instantiated in the .cu files for ReluOut, ReluGradInput, SgdUpdate,
// FillOut, BinaryOut<op>, BinarySameOut<op>, BinaryScalarOut<op> (every BinaryOp).
template <class Body>
void for_each_index(int64_t n, const Body& body, cudaStream_t stream);

// ---- reductions and conversions (elementwise.cu) ----
// *out = sum of x[0, n) (n == 0 gives 0), as ops::sum: accumulated in double, rounded to float
// once. One block of 256 threads: thread t adds x[t], x[t + 256], ... in order, then a
// shared-memory tree of fixed shape adds the 256 partial sums, so the result is bitwise
// reproducible (though not bitwise equal to the CPU's index order).
void sum_all(int64_t n, const float* x, float* out, cudaStream_t stream);
// y[i] = static_cast<To>(x[i]) for i in [0, n) (ops::astype), To and From each one of float,
// int32_t, int64_t, uint8_t (all 16 pairs are instantiated). Integer to integer wraps as on the
// CPU; float to an integer type truncates toward zero, and a value outside the target's range
// (or NaN) is undefined behaviour in C++ and differs between CPU (x86) and GPU (saturating).
template <class To, class From>
void convert(int64_t n, const From* x, To* y, cudaStream_t stream);

}  // namespace mgpu::ops::cuda

// ---- Vendor libraries: real CUDA builds only (never compiled into the emulated build) ----
#if !defined(MGPU_CUDA_EMULATION)
struct cublasContext;  // cublasHandle_t
struct cudnnContext;   // cudnnHandle_t

namespace mgpu::ops::cuda {

// gemm_cublas.cu: the same contract as sgemm above, through cublasSgemm on the handle's stream
// (the caller binds handle and stream). Compiled and linked only: never run.
void sgemm_cublas(cublasContext* handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                  int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float beta, float* c, int64_t ldc);

// conv2d_cudnn.cu: conv2d through cuDNN's legacy convolution API (cudnn_cnn, still in cuDNN 9),
// with deterministic algorithms (forward IMPLICIT_GEMM, backward data/filter ALGO_1), selected at
// run time by the op (MGPU_CONV=cudnn|native, the plumbing step). The workspace is the caller's:
// at least conv2d_cudnn_workspace_bytes(handle, s) bytes. Compiled and linked only: never run.
size_t conv2d_cudnn_workspace_bytes(cudnnContext* handle, const Conv2dShape& s);
void conv2d_cudnn_forward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                          const float* w, const float* b, float* y, void* workspace,
                          size_t workspace_bytes);
void conv2d_cudnn_backward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                           const float* w, const float* dy, float* dx, float* dw, float* db,
                           void* workspace, size_t workspace_bytes);

}  // namespace mgpu::ops::cuda
#endif
