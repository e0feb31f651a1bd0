// cpp/ops/vendor_gpu.h -- which library runs a GPU's matrix products and convolutions, and the
// per-device library handles. Real CUDA builds use cuBLAS for mm (MGPU_GEMM=native picks our own
// tiled kernel) and our conv kernels (MGPU_CONV=cudnn picks cuDNN where it was built). The emulated
// build has no vendor library: our kernels always run there, as build_info() says.
#pragma once

#include <cstddef>

#include "core/gpu.h"

struct cublasContext;
struct cudnnContext;

namespace mgpu::ops {

// Whether this build links cuBLAS / cuDNN (never the emulated build: they cannot run there).
#if MGPU_BUILT_CUDA && !MGPU_CUDA_EMULATION_BUILD
inline constexpr bool kCublas = true;
#else
inline constexpr bool kCublas = false;
#endif
#if MGPU_BUILT_CUDNN && !MGPU_CUDA_EMULATION_BUILD
inline constexpr bool kCudnn = true;
#else
inline constexpr bool kCudnn = false;
#endif

enum class GemmPath { Native, Cublas };
enum class ConvPath { Native, Cudnn };

// Read from MGPU_GEMM / MGPU_CONV at every call; a value this build cannot honour raises
// ValueError with the accepted values.
GemmPath gemm_path();
ConvPath conv_path();

// Scratch memory on a GPU from the caching allocator (a vendor library's workspace, bfloat16
// copies of its operands), handed back once the calls that use it are enqueued: a later user of
// the block is ordered after them on the same stream. ptr is null for 0 bytes.
struct GpuScratch {
  int device;
  size_t bytes, capacity = 0;
  void* ptr = nullptr;
  GpuScratch(int d, size_t n) : device(d), bytes(n) {
    if (n) ptr = gpu::allocate(d, n, &capacity);
  }
  ~GpuScratch() {
    if (ptr) gpu::release(device, ptr, capacity);
  }
  GpuScratch(const GpuScratch&) = delete;
  GpuScratch& operator=(const GpuScratch&) = delete;
};

namespace cuda {
// The calling thread's current device's handles (a GPU worker's), created on first use, bound to
// the device's compute stream. Defined only where the library is linked (kCublas, kCudnn).
cublasContext* cublas_handle(int device);
cudnnContext* cudnn_handle(int device);
}  // namespace cuda

}  // namespace mgpu::ops
