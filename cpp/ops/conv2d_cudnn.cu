// cpp/ops/conv2d_cudnn.cu -- conv2d forward and backward through cuDNN's legacy convolution API
// (deprecated in cuDNN 9 but shipped), the alternative the op picks with MGPU_CONV=cudnn. NCHW
// float32; fixed deterministic algorithms and FMA math (no TF32), so results match our kernels to
// float tolerance. Real CUDA builds only: compiled and linked by nvcc; without a GPU a test
// runs the empty-shape guards only (test_gpu_defects.py), on cuDNN's host-only descriptor calls.
#include <cudnn.h>

#include <algorithm>
#include <mutex>

#include "core/gpu.h"
#include "ops/launch.cuh"
#include "ops/conv2d.h"
#include "ops/vendor_gpu.h"

namespace mgpu::ops::cuda {

namespace {

constexpr cudnnConvolutionFwdAlgo_t kForwardAlgo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
constexpr cudnnConvolutionBwdDataAlgo_t kDataAlgo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
constexpr cudnnConvolutionBwdFilterAlgo_t kFilterAlgo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;

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
// next to a convolution).
struct Descriptors {
  TensorDesc x, y, bias;
  FilterDesc w;
  ConvDesc conv;
  explicit Descriptors(const Conv2dShape& s) {
    const char* op = "cuda::conv2d_cudnn";
    using detail::as_int;
    detail::require(s.stride >= 1 && s.pad >= 0 && s.P() >= 1 && s.Q() >= 1, op,
                    "needs stride >= 1, pad >= 0 and a kernel that fits the padded image");
    const int N = as_int(op, "N", s.N), C = as_int(op, "C", s.C), H = as_int(op, "H", s.H),
              W = as_int(op, "W", s.W), K = as_int(op, "K", s.K);
    check(cudnnSetTensor4dDescriptor(x.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, C, H, W),
          "cudnnSetTensor4dDescriptor(x)");
    check(cudnnSetTensor4dDescriptor(y.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, K,
                                     as_int(op, "P", s.P()), as_int(op, "Q", s.Q())),
          "cudnnSetTensor4dDescriptor(y)");
    check(cudnnSetTensor4dDescriptor(bias.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, K, 1, 1),
          "cudnnSetTensor4dDescriptor(b)");
    check(cudnnSetFilter4dDescriptor(w.get(), CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, C,
                                     as_int(op, "R", s.R), as_int(op, "S", s.S)),
          "cudnnSetFilter4dDescriptor(w)");
    const int pad = as_int(op, "pad", s.pad), stride = as_int(op, "stride", s.stride);
    check(cudnnSetConvolution2dDescriptor(conv.get(), pad, pad, stride, stride, 1, 1,
                                          CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
          "cudnnSetConvolution2dDescriptor");
    // FMA math: no TF32 (10-bit mantissas), which would break the agreement with the CPU.
    check(cudnnSetConvolutionMathType(conv.get(), CUDNN_FMA_MATH), "cudnnSetConvolutionMathType");
  }
};

void require_workspace(size_t have, size_t need) {
  detail::require(have >= need, "cuda::conv2d_cudnn",
                  "the workspace has " + std::to_string(have) + " bytes but cuDNN needs " +
                      std::to_string(need) + "; size it with conv2d_cudnn_workspace_bytes");
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
  const Descriptors d(s);
  size_t fwd = 0, data = 0, filter = 0;
  check(cudnnGetConvolutionForwardWorkspaceSize(handle, d.x.get(), d.w.get(), d.conv.get(),
                                                d.y.get(), kForwardAlgo, &fwd),
        "cudnnGetConvolutionForwardWorkspaceSize");
  check(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, d.w.get(), d.y.get(), d.conv.get(),
                                                     d.x.get(), kDataAlgo, &data),
        "cudnnGetConvolutionBackwardDataWorkspaceSize");
  check(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, d.x.get(), d.y.get(), d.conv.get(),
                                                       d.w.get(), kFilterAlgo, &filter),
        "cudnnGetConvolutionBackwardFilterWorkspaceSize");
  return std::max(fwd, std::max(data, filter));
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

}  // namespace mgpu::ops::cuda
