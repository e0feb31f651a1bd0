// cpp/ops/conv2d.h -- 2-D convolution (cross-correlation, as in the chapter's F.conv2d) with
// stride and zero padding. Shapes: x (N, C, H, W), w (K, C, R, S), b (K,), y (N, K, P, Q) with
// P = (H + 2*pad - R) / stride + 1, Q likewise. Forward keeps nothing; backward re-reads x and w
// and writes dx, dw, db (never adds into them). Kernels: conv2d_cpu.cpp, conv2d.cu, conv2d_cudnn.cu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "cuda/stream.h"
#include "ops/precision.h"

struct cudnnContext;  // cudnnHandle_t

namespace mgpu::ops {

// The CPU conv's algorithms, as MGPU_CONV_ALGO names them (see cpu::conv_algo below).
enum class ConvAlgo { Auto, Tune, Direct, Im2col, Winograd };
// "auto", "tune", "direct", "im2col" or "winograd".
const char* conv_algo_name(ConvAlgo algo);
// The algorithm a conv on device d runs by MGPU_CONV_ALGO: cpu::conv_algo() on a CPU (a bad
// value raises), Auto (ignored) on a GPU.
ConvAlgo conv_algo_for(Device d);

struct Conv2dGrads {
  Tensor dx, dw, db;  // db undefined when the conv has no bias; dx when not asked for
};

// algo: the CPU conv's algorithm (ConvAlgo below), decided by the caller once: the fused step's
// Model when it is built (per conv layer), the book's ops at each call (conv_algo_for). GPUs
// ignore it. precision BF16 runs every product with bfloat16 operands and float32 sums
// (ops/bf16.h; on GPUs ops/bf16_gpu.h) with its own kernels: on a CPU, winograd picks Winograd
// F(2x2, 3x3) for the forward and data gradient of a 3x3 stride-1 layer, the other algorithms
// the im2col products (bf16.h).
Tensor conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, int64_t stride,
                      int64_t pad, ConvAlgo algo, Precision precision = Precision::F32);
Conv2dGrads conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, int64_t stride,
                            int64_t pad, bool need_dx, bool has_bias, ConvAlgo algo,
                            Precision precision = Precision::F32);

// The kernels' view of a conv: the same stride and zero padding on both axes.
// Preconditions of every kernel: stride >= 1, pad >= 0, P() >= 1, Q() >= 1.
struct Conv2dShape {
  int64_t N, C, H, W, K, R, S, stride, pad;
  int64_t P() const { return (H + 2 * pad - R) / stride + 1; }
  int64_t Q() const { return (W + 2 * pad - S) / stride + 1; }
};

// The kernels (float32, NCHW contiguous, raw pointers; the caller checks shapes and allocates)
// write their outputs and never overlap them with inputs. cpu:: gives bitwise-identical results
// whatever the thread count; cuda:: launchers enqueue on `stream` and return, throw
// std::invalid_argument for a shape they cannot launch, and add every sum in a fixed order.
namespace cpu {
// Writes y = conv(x, w) + b; b may be null (no bias).
void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b, float* y);
// Given dy (N, K, P, Q), writes dx (N, C, H, W), dw (K, C, R, S) and db (K); dx and db may be null
// to skip them (LeNet's first layer needs no dx), dw may not. dw and db sum over the batch in
// fixed blocks of images (8 or 16, by shape), then over the blocks in order, so the order of
// additions depends on the shape but never on the thread count.
void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db);

// Which algorithm the CPU conv2d_forward / conv2d_backward run, from MGPU_CONV_ALGO:
// - auto (or unset): Winograd F(4x4, 3x3) for 3x3 stride-1 convs with pad <= 2, >= 16 channels
//   in and out and outputs of at least 6x6 (ResNet-18's 28x28, 14x14 and 7x7 layers, where it
//   measured faster), or outputs in whole 4x4 tiles with >= 512 channels in and out (ResNet-18's
//   4x4 layers), the shape's rule for the rest. A function of the shape alone, like every
//   other choice here, so every process, rank and run computes the same bits.
// - tune: like cuDNN's benchmark mode, for the same eligible shapes (any output size) the first
//   call for a shape (without the batch size) in this process times Winograd against the rule
//   and keeps the faster; not cached across processes, so two processes may pick differently.
// - direct: the shape's rule (direct loops or lanes without padding, im2col + sgemm otherwise;
//   the only choice before Winograd).
// - im2col: im2col + sgemm for every shape.
// - winograd: Winograd for every 3x3 stride-1 conv with pad <= 2, direct for the rest.
// conv2d_relu_pool (LeNet's fused blocks) always runs the shape's rule.
// conv2d_forward_algo / conv2d_backward_algo run the algorithm they are given; conv2d_forward /
// conv2d_backward (the kernels' tests and benchmarks) read MGPU_CONV_ALGO at every call.
void conv2d_forward_algo(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, ConvAlgo algo);
void conv2d_backward_algo(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, ConvAlgo algo);
// MGPU_CONV_ALGO now: the variable is looked up at every call (a test or a benchmark may switch
// it between calls) but a value is parsed once. Throws ValueError for a value it does not know.
ConvAlgo conv_algo();
// One line per shape tune has measured in this process (direction, shape, pick, both times).
std::string conv_autotune_report();
}  // namespace cpu

namespace cuda {
// Forward as cpu::, b may be null. Shared-memory tiles: a block computes an 8 x 16 tile of y for 4
// output channels of one image, staging the input patch and the weights of one input channel at a
// time.
void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b, float* y,
                    cudaStream_t stream);
// Backward as cpu::; dx and db may be null, dw may not. dx is the gather form: each dx element
// sums, over k then r then s, the dy elements it fed (a block stages a dy patch and w for 4 input
// channels per k). dw[k, c] (and db[k], alongside the c == 0 blocks) is one block's sum over
// N, P, Q: each thread adds its positions in order, then a shared-memory tree of fixed shape adds
// the threads. Precondition: R * S <= 64 (the per-thread partial sums live in shared memory).
void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db, cudaStream_t stream);

// Through cuDNN's legacy convolution API (cudnn_cnn, still in cuDNN 9), with deterministic
// algorithms (forward IMPLICIT_GEMM, backward data/filter ALGO_1); picked at run time by the op
// when MGPU_CONV=cudnn (vendor_gpu.h). The workspace is the caller's: at least
// conv2d_cudnn_workspace_bytes(handle, s) bytes. Real CUDA builds with cuDNN only (cuDNN cannot
// run on emulated GPUs); without a GPU, a test runs only the empty-shape guards of the workspace
// size and the forward (test_gpu_defects.py, through _core._cudnn_conv_without_handle).
size_t conv2d_cudnn_workspace_bytes(cudnnContext* handle, const Conv2dShape& s);
void conv2d_cudnn_forward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                          const float* w, const float* b, float* y, void* workspace,
                          size_t workspace_bytes);
void conv2d_cudnn_backward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                           const float* w, const float* dy, float* dx, float* dw, float* db,
                           void* workspace, size_t workspace_bytes);
}  // namespace cuda

}  // namespace mgpu::ops
