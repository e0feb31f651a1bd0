// cpp/ops/bf16_gpu.h -- the bfloat16 products (ops/bf16.h) on GPUs: mm and conv2d's forward, data
// gradient and weight gradient with float32 inputs and outputs, bfloat16 operands and float32
// sums. Our kernels (bf16.cu) run on every GPU build, emulated GPUs included; the cuBLAS and cuDNN
// paths (linear_cublas.cu, conv2d_cudnn.cu) in real CUDA builds only, chosen as the float32 ones
// are (MGPU_GEMM, MGPU_CONV; vendor_gpu.h).
//
// Our kernels give the CPU's bits. Each output is one thread's sum in bf16.h's order: operands
// read with denormals as zeros of their sign and rounded to nearest even (__float2bfloat16_rn),
// k cut into pairs (the odd one padded with a zero), per pair the odd element's product then the
// even one's, each an fmaf whose denormal result is flushed to a zero of its sign; conv2d adds
// the bias after the sum (0.0f without one), gathers dx over (r, s) in order from zero, runs dw's
// sum in the CPU's chunks of images (its pairs restart at each chunk) and db's (of dy rounded to
// bfloat16) in float per image and in double over images. So CPU devices and GPUs, and any number of either, agree bit
// for bit. Two exceptions, both outside training's range: a NaN result carries the canonical
// NaN (0x7fff) where the CPU keeps an input's payload, and a partial sum whose exact value lies
// between 2^-126 - 2^-150 and 2^-126 - 2^-151 (just below FLT_MIN) becomes FLT_MIN here, where the
// CPU's FTZ flushes it to zero (x86 rounds to 24 bits with unbounded exponent before it decides
// tininess; fmaf rounds to the subnormal grid, whose step there is 2^-149).
//
// The vendor libraries sum in their own order: within bf16.h's error bound, not bitwise. cuBLAS
// (cublasGemmEx, CUDA_R_16BF operands, CUBLAS_COMPUTE_32F, float32 output) reads operands that
// bf16_round_operands rounded exactly as above. cuDNN's legacy API takes bfloat16 operands only
// with bfloat16 outputs (its BFLOAT16 configuration, float32 compute): its y, dx and dw are
// rounded to bfloat16 once more before they widen to float32, adding u = 2^-8 of |y| to the
// bound; db is summed in float32 from float32 dy (not rounded, unlike mgpu's kernels: compiled,
// never run here).
#pragma once

#include <cstdint>

#include "cuda/stream.h"
#include "ops/conv2d.h"

struct cublasContext;

namespace mgpu::ops::cuda {

// c (m, n, contiguous) = op(a) @ op(b) in bfloat16 (the CPU's cpu::bf16_mm bits); op(a) (m, k)
// is a^T when trans_a, rows lda floats apart; op(b) (k, n) likewise.
void bf16_mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, cudaStream_t stream);
// conv2d's passes in bfloat16 (cpu::bf16_conv2d_forward / _backward's bits with the im2col
// products, ConvAlgo::Direct; GPUs have no bf16 Winograd); b, dx and db may be null.
void bf16_conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, cudaStream_t stream);
void bf16_conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, cudaStream_t stream);

// out[i] = the bfloat16 bits of x[i] as the products round their operands (denormals to zero,
// then nearest even), for the vendor libraries; widen is the way back (exact).
void bf16_round_operands(int64_t n, const float* x, uint16_t* out, cudaStream_t stream);
void bf16_widen(int64_t n, const uint16_t* x, float* out, cudaStream_t stream);
// out[i] = x[i] rounded so, as a float (precision.h's bf16_round).
void bf16_round_to_float(int64_t n, const float* x, float* out, cudaStream_t stream);

// cuBLAS: c (m, n, row stride ldc) = op(a) @ op(b) from bfloat16 operands (row-major, as
// cuda::sgemm_cublas), float32 sums and output. Real CUDA builds only.
void bf16_mm_cublas(cublasContext* handle, bool trans_a, bool trans_b, int64_t m, int64_t n,
                    int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                    float* c, int64_t ldc);

// cuDNN: conv2d's passes (float32 in and out, cuda::conv2d_cudnn_*'s contract) on bfloat16
// copies of x, w and dy (rounded by bf16_round_operands) with float32 compute; y, dx and dw come
// back from cuDNN in bfloat16 and are widened; the bias is added (and db summed) in float32. The
// workspace is the caller's, at least conv2d_cudnn_bf16_workspace_bytes(handle, s): cuDNN's own
// and the bfloat16 copies. Real CUDA builds with cuDNN only.
size_t conv2d_cudnn_bf16_workspace_bytes(cudnnContext* handle, const Conv2dShape& s);
void conv2d_cudnn_bf16_forward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                               const float* w, const float* b, float* y, void* workspace,
                               size_t workspace_bytes);
void conv2d_cudnn_bf16_backward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                                const float* w, const float* dy, float* dx, float* dw, float* db,
                                void* workspace, size_t workspace_bytes);

}  // namespace mgpu::ops::cuda
