// cpp/ops/conv2d_cudnn.cu -- conv2d forward and backward through cuDNN's legacy convolution API
// (deprecated in cuDNN 9 but shipped), the alternative the op picks with MGPU_CONV=cudnn. NCHW
// float32; fixed deterministic algorithms and FMA math (no TF32), so results match our kernels to
// float tolerance. The bfloat16 forms (bf16_gpu.h) run cuDNN's bfloat16 configuration (bfloat16
// tensors, float32 compute, tensor-op math) on rounded copies and widen its bfloat16 outputs. Real CUDA builds only: compiled and linked by nvcc; without a GPU a test
// runs the empty-shape guards only (test_gpu_defects.py), on cuDNN's host-only descriptor calls.
#include <cudnn.h>

#include <algorithm>
#include <mutex>

#include "core/gpu.h"
#include "ops/launch.cuh"
#include "ops/bf16_gpu.h"
#include "ops/conv2d.h"
#include "ops/vendor_gpu.h"

namespace mgpu::ops::cuda {

namespace {

constexpr cudnnConvolutionFwdAlgo_t kForwardAlgo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
constexpr cudnnConvolutionBwdDataAlgo_t kDataAlgo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
constexpr cudnnConvolutionBwdFilterAlgo_t kFilterAlgo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
// bfloat16's forward: the precomputed implicit GEMM, deterministic and tensor-op capable.
constexpr cudnnConvolutionFwdAlgo_t kForwardAlgoBf16 =
    CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;

void check(cudnnStatus_t status, const char* call) {
  if (status != CUDNN_STATUS_SUCCESS) {
    throw ::mgpu::DeviceError(std::string("cuda::conv2d_cudnn: ") + call +
                              " failed: " + cudnnGetErrorString(status));
  }
}

// A descriptor that destroys itself (a constructor that throws half-way leaks nothing).
template <class T, cudnnStatus_t (*Create)(T*), cudnnStatus_t (*Destroy)(T)>
class Owned {
 public:
  Owned() { check(Create(&handle_), "creating a descriptor"); }
  ~Owned() { Destroy(handle_); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  T get() const { return handle_; }

 private:
  T handle_ = nullptr;
};
using TensorDesc =
    Owned<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDesc =
    Owned<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDesc = Owned<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                       cudnnDestroyConvolutionDescriptor>;

// The descriptors of one shape, built per call (cuDNN's descriptor calls are host-only and cheap
// next to a convolution): x, y and w in `data` (float32, or bfloat16 with float32 compute), the
// bias always float32.
struct Descriptors {
  TensorDesc x, y, bias;
  FilterDesc w;
  ConvDesc conv;
  explicit Descriptors(const Conv2dShape& s, cudnnDataType_t data = CUDNN_DATA_FLOAT) {
    const char* op = "cuda::conv2d_cudnn";
    using detail::as_int;
    detail::require(s.stride >= 1 && s.pad >= 0 && s.P() >= 1 && s.Q() >= 1, op,
                    "needs stride >= 1, pad >= 0 and a kernel that fits the padded image");
    const int N = as_int(op, "N", s.N), C = as_int(op, "C", s.C), H = as_int(op, "H", s.H),
              W = as_int(op, "W", s.W), K = as_int(op, "K", s.K);
    check(cudnnSetTensor4dDescriptor(x.get(), CUDNN_TENSOR_NCHW, data, N, C, H, W),
          "cudnnSetTensor4dDescriptor(x)");
    check(cudnnSetTensor4dDescriptor(y.get(), CUDNN_TENSOR_NCHW, data, N, K,
                                     as_int(op, "P", s.P()), as_int(op, "Q", s.Q())),
          "cudnnSetTensor4dDescriptor(y)");
    check(cudnnSetTensor4dDescriptor(bias.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, K, 1, 1),
          "cudnnSetTensor4dDescriptor(b)");
    check(cudnnSetFilter4dDescriptor(w.get(), data, CUDNN_TENSOR_NCHW, K, C,
                                     as_int(op, "R", s.R), as_int(op, "S", s.S)),
          "cudnnSetFilter4dDescriptor(w)");
    const int pad = as_int(op, "pad", s.pad), stride = as_int(op, "stride", s.stride);
    check(cudnnSetConvolution2dDescriptor(conv.get(), pad, pad, stride, stride, 1, 1,
                                          CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
          "cudnnSetConvolution2dDescriptor");
    // float32: FMA math, no TF32 (10-bit mantissas), which would break the agreement with the
    // CPU. bfloat16: tensor cores, whose products of bfloat16 operands are exact.
    check(cudnnSetConvolutionMathType(
              conv.get(), data == CUDNN_DATA_FLOAT ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH),
          "cudnnSetConvolutionMathType");
  }
};

void require_workspace(size_t have, size_t need) {
  detail::require(have >= need, "cuda::conv2d_cudnn",
                  "the workspace has " + std::to_string(have) + " bytes but cuDNN needs " +
                      std::to_string(need) + "; size it with conv2d_cudnn_workspace_bytes");
}

// The workspace the forward (by `forward`), the data gradient and the filter gradient need, the
// largest of the three.
size_t largest_workspace(cudnnContext* handle, const Descriptors& d,
                         cudnnConvolutionFwdAlgo_t forward) {
  size_t fwd = 0, data = 0, filter = 0;
  check(cudnnGetConvolutionForwardWorkspaceSize(handle, d.x.get(), d.w.get(), d.conv.get(),
                                                d.y.get(), forward, &fwd),
        "cudnnGetConvolutionForwardWorkspaceSize");
  check(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, d.w.get(), d.y.get(), d.conv.get(),
                                                     d.x.get(), kDataAlgo, &data),
        "cudnnGetConvolutionBackwardDataWorkspaceSize");
  check(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, d.x.get(), d.y.get(), d.conv.get(),
                                                       d.w.get(), kFilterAlgo, &filter),
        "cudnnGetConvolutionBackwardFilterWorkspaceSize");
  return std::max(fwd, std::max(data, filter));
}

}  // namespace

cudnnContext* cudnn_handle(int device) {
  static std::mutex mutex;
  static cudnnHandle_t handles[gpu::kMaxGpus] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (!handles[device]) {
    gpu::set_device(device);
    cudnnHandle_t h = nullptr;
    check(cudnnCreate(&h), "cudnnCreate");
    check(cudnnSetStream(h, gpu::compute_stream(device)), "cudnnSetStream");
    handles[device] = h;
  }
  return handles[device];
}

size_t conv2d_cudnn_workspace_bytes(cudnnContext* handle, const Conv2dShape& s) {
  // An empty batch or filter bank needs no workspace, and cuDNN refuses descriptors with a zero
  // dimension (CUDNN_STATUS_BAD_PARAM): forward and backward handle those shapes without cuDNN.
  if (s.N == 0 || s.K == 0) return 0;
  return largest_workspace(handle, Descriptors(s), kForwardAlgo);
}

void conv2d_cudnn_forward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                          const float* w, const float* b, float* y, void* workspace,
                          size_t workspace_bytes) {
  if (s.N == 0 || s.K == 0) return;
  const Descriptors d(s);
  size_t need = 0;
  check(cudnnGetConvolutionForwardWorkspaceSize(handle, d.x.get(), d.w.get(), d.conv.get(),
                                                d.y.get(), kForwardAlgo, &need),
        "cudnnGetConvolutionForwardWorkspaceSize");
  require_workspace(workspace_bytes, need);
  const float one = 1.0f, zero = 0.0f;
  check(cudnnConvolutionForward(handle, &one, d.x.get(), x, d.w.get(), w, d.conv.get(),
                                kForwardAlgo, workspace, workspace_bytes, &zero, d.y.get(), y),
        "cudnnConvolutionForward");
  if (b != nullptr) {
    check(cudnnAddTensor(handle, &one, d.bias.get(), b, &one, d.y.get(), y), "cudnnAddTensor");
  }
}

void conv2d_cudnn_backward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                           const float* w, const float* dy, float* dx, float* dw, float* db,
                           void* workspace, size_t workspace_bytes) {
  detail::require(dw != nullptr, "cuda::conv2d_cudnn_backward", "dw must not be null");
  if (s.N == 0) {  // cuDNN rejects empty tensors; the gradients of an empty batch are zero
    cudaStream_t stream = nullptr;
    check(cudnnGetStream(handle, &stream), "cudnnGetStream");
    MGPU_CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * s.K * s.C * s.R * s.S, stream));
    if (db != nullptr) MGPU_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * s.K, stream));
    return;
  }
  if (s.K == 0) {  // no filters: nothing flows back to x, and dw, db are empty
    cudaStream_t stream = nullptr;
    check(cudnnGetStream(handle, &stream), "cudnnGetStream");
    if (dx != nullptr) {
      MGPU_CUDA_CHECK(cudaMemsetAsync(dx, 0, sizeof(float) * s.N * s.C * s.H * s.W, stream));
    }
    return;
  }
  const Descriptors d(s);
  const float one = 1.0f, zero = 0.0f;
  if (dx != nullptr) {
    size_t need = 0;
    check(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, d.w.get(), d.y.get(), d.conv.get(),
                                                       d.x.get(), kDataAlgo, &need),
          "cudnnGetConvolutionBackwardDataWorkspaceSize");
    require_workspace(workspace_bytes, need);
    check(cudnnConvolutionBackwardData(handle, &one, d.w.get(), w, d.y.get(), dy, d.conv.get(),
                                       kDataAlgo, workspace, workspace_bytes, &zero, d.x.get(), dx),
          "cudnnConvolutionBackwardData");
  }
  size_t need = 0;
  check(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, d.x.get(), d.y.get(), d.conv.get(),
                                                       d.w.get(), kFilterAlgo, &need),
        "cudnnGetConvolutionBackwardFilterWorkspaceSize");
  require_workspace(workspace_bytes, need);
  check(
      cudnnConvolutionBackwardFilter(handle, &one, d.x.get(), x, d.y.get(), dy, d.conv.get(),
                                     kFilterAlgo, workspace, workspace_bytes, &zero, d.w.get(), dw),
      "cudnnConvolutionBackwardFilter");
  if (db != nullptr) {
    check(cudnnConvolutionBackwardBias(handle, &one, d.y.get(), dy, &zero, d.bias.get(), db),
          "cudnnConvolutionBackwardBias");
  }
}

// ---- bfloat16 ----
namespace {

constexpr size_t kAlign = 256;
size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The bfloat16 forms' workspace: cuDNN's own, then bfloat16 copies of x, w, dy (or y), dx, dw
// (byte offsets); nx, nw, ny count the elements of x, w and y.
struct Bf16Layout {
  int64_t nx, nw, ny;
  size_t cudnn = 0, x = 0, w = 0, y = 0, dx = 0, dw = 0, total = 0;
  Bf16Layout(cudnnContext* handle, const Conv2dShape& s)
      : nx(s.N * s.C * s.H * s.W), nw(s.K * s.C * s.R * s.S), ny(s.N * s.K * s.P() * s.Q()) {
    if (s.N == 0 || s.K == 0) return;
    cudnn = aligned(largest_workspace(handle, Descriptors(s, CUDNN_DATA_BFLOAT16),
                                      kForwardAlgoBf16));
    x = cudnn;
    w = x + aligned(bytes(nx));
    y = w + aligned(bytes(nw));
    dx = y + aligned(bytes(ny));
    dw = dx + aligned(bytes(nx));
    total = dw + aligned(bytes(nw));
  }
  static size_t bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(uint16_t); }
  uint16_t* at(void* workspace, size_t offset) const {
    return reinterpret_cast<uint16_t*>(static_cast<unsigned char*>(workspace) + offset);
  }
};

cudaStream_t stream_of(cudnnContext* handle) {
  cudaStream_t stream = nullptr;
  check(cudnnGetStream(handle, &stream), "cudnnGetStream");
  return stream;
}

}  // namespace

size_t conv2d_cudnn_bf16_workspace_bytes(cudnnContext* handle, const Conv2dShape& s) {
  return Bf16Layout(handle, s).total;
}

void conv2d_cudnn_bf16_forward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                               const float* w, const float* b, float* y, void* workspace,
                               size_t workspace_bytes) {
  if (s.N == 0 || s.K == 0) return;
  const Bf16Layout l(handle, s);
  require_workspace(workspace_bytes, l.total);
  const Descriptors d(s, CUDNN_DATA_BFLOAT16), f(s);
  cudaStream_t stream = stream_of(handle);
  uint16_t *x16 = l.at(workspace, l.x), *w16 = l.at(workspace, l.w), *y16 = l.at(workspace, l.y);
  bf16_round_operands(l.nx, x, x16, stream);
  bf16_round_operands(l.nw, w, w16, stream);
  const float one = 1.0f, zero = 0.0f;
  check(cudnnConvolutionForward(handle, &one, d.x.get(), x16, d.w.get(), w16, d.conv.get(),
                                kForwardAlgoBf16, workspace, l.cudnn, &zero, d.y.get(), y16),
        "cudnnConvolutionForward(bfloat16)");
  bf16_widen(l.ny, y16, y, stream);
  if (b != nullptr) {
    check(cudnnAddTensor(handle, &one, f.bias.get(), b, &one, f.y.get(), y), "cudnnAddTensor");
  }
}

void conv2d_cudnn_bf16_backward(cudnnContext* handle, const Conv2dShape& s, const float* x,
                                const float* w, const float* dy, float* dx, float* dw, float* db,
                                void* workspace, size_t workspace_bytes) {
  if (s.N == 0 || s.K == 0) {  // the float32 form's zero-fills, without touching cuDNN's math
    conv2d_cudnn_backward(handle, s, x, w, dy, dx, dw, db, workspace, workspace_bytes);
    return;
  }
  detail::require(dw != nullptr, "cuda::conv2d_cudnn_bf16_backward", "dw must not be null");
  const Bf16Layout l(handle, s);
  require_workspace(workspace_bytes, l.total);
  const Descriptors d(s, CUDNN_DATA_BFLOAT16), f(s);
  cudaStream_t stream = stream_of(handle);
  uint16_t *x16 = l.at(workspace, l.x), *w16 = l.at(workspace, l.w);
  uint16_t *dy16 = l.at(workspace, l.y), *dx16 = l.at(workspace, l.dx);
  uint16_t* dw16 = l.at(workspace, l.dw);
  bf16_round_operands(l.ny, dy, dy16, stream);
  const float one = 1.0f, zero = 0.0f;
  if (dx != nullptr) {
    bf16_round_operands(l.nw, w, w16, stream);
    check(cudnnConvolutionBackwardData(handle, &one, d.w.get(), w16, d.y.get(), dy16,
                                       d.conv.get(), kDataAlgo, workspace, l.cudnn, &zero,
                                       d.x.get(), dx16),
          "cudnnConvolutionBackwardData(bfloat16)");
    bf16_widen(l.nx, dx16, dx, stream);
  }
  bf16_round_operands(l.nx, x, x16, stream);
  check(cudnnConvolutionBackwardFilter(handle, &one, d.x.get(), x16, d.y.get(), dy16,
                                       d.conv.get(), kFilterAlgo, workspace, l.cudnn, &zero,
                                       d.w.get(), dw16),
        "cudnnConvolutionBackwardFilter(bfloat16)");
  bf16_widen(l.nw, dw16, dw, stream);
  if (db != nullptr) {
    check(cudnnConvolutionBackwardBias(handle, &one, f.y.get(), dy, &zero, f.bias.get(), db),
          "cudnnConvolutionBackwardBias");
  }
}

}  // namespace mgpu::ops::cuda
