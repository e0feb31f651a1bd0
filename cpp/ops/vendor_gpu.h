// cpp/ops/vendor_gpu.h -- which library runs a GPU's matrix products and convolutions, and the
// per-device library handles. Real CUDA builds use cuBLAS for mm (MGPU_GEMM=native picks our own
// tiled kernel) and our conv kernels (MGPU_CONV=cudnn picks cuDNN where it was built). The emulated
// build has no vendor library: our kernels always run there, as build_info() says.
// Compiled and linked with nvcc; the vendor paths have never run (no GPU here).
#pragma once

#include <string>

struct cublasContext;
struct cudnnContext;

namespace mgpu::ops {

enum class GemmPath { Native, Cublas };
enum class ConvPath { Native, Cudnn };

// Read once from MGPU_GEMM / MGPU_CONV; a value this build cannot honour raises ValueError with
// the accepted values.
GemmPath gemm_path();
ConvPath conv_path();
std::string gemm_path_name();
std::string conv_path_name();

namespace cuda {
// The calling thread's current device's handles (a GPU worker's), created on first use, bound to
// the device's compute stream. Defined only where the library was built.
cublasContext* cublas_handle(int device);
cudnnContext* cudnn_handle(int device);
}  // namespace cuda

}  // namespace mgpu::ops
