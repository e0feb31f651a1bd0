// cpp/cuda/runtime.cuh -- the bottom floor of the GPU backend: the CUDA runtime (nvcc, or g++ with
// the CUDA include path) or mgpu's emulator of it (g++ with MGPU_CUDA_EMULATION, cuda/emu/), the
// two constructs in which mgpu's kernels differ from plain CUDA (MGPU_LAUNCH, MGPU_DYNAMIC_SHARED)
// and MGPU_CUDA_CHECK, which turns a failed runtime call into an exception.
#pragma once

#include <string>

#if defined(MGPU_CUDA_EMULATION)
#include "cuda/emu/cuda_emulation.h"
#else
#include <cuda_runtime.h>
#endif

// MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...) is kernel<<<...>>>(args...);
// MGPU_DYNAMIC_SHARED(type, name); declares `type* name`, the block's dynamic shared memory.
// A macro argument must not contain a top-level comma: launch a template kernel with several
// arguments through a pointer (`auto* k = gemm<float, 16>; MGPU_LAUNCH(k, ...)`), and pass dim3
// values, not braced lists.
#if defined(MGPU_CUDA_EMULATION)

#define MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::mgpu::emu::make_launcher(kernel, #kernel, __FILE__, __LINE__, grid, block, shared_bytes, stream)
#define MGPU_DYNAMIC_SHARED(type, name) MGPU_EMU_DYNAMIC_SHARED(type, name)

#else

#define MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<grid, block, shared_bytes, stream>>>
// One raw, 16-byte aligned array for every kernel, viewed as `type`: nvcc rejects two
// `extern __shared__` arrays of one name but different types in a file, and float4 or double
// views need the alignment.
#define MGPU_DYNAMIC_SHARED(type, name)                                 \
  extern __shared__ __align__(16) unsigned char mgpu_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(mgpu_dynamic_shared_)

#endif

// The exception MGPU_CUDA_CHECK throws. The engine defines it as ::mgpu::DeviceError before
// including this header; standalone users get std::runtime_error.
#ifndef MGPU_CUDA_ERROR_TYPE
#include <stdexcept>
#define MGPU_CUDA_ERROR_TYPE std::runtime_error
#endif

namespace mgpu::cuda_detail {
inline std::string error_message(cudaError_t error, const char* expr, const char* file, int line) {
  std::string out = std::string("CUDA error ") + cudaGetErrorName(error) + " (" +
                    cudaGetErrorString(error) + ") from `" + expr + "` at " + file + ":" +
                    std::to_string(line);
#if defined(MGPU_CUDA_EMULATION)
  const std::string& detail = ::mgpu::emu::last_error_detail();
  if (!detail.empty()) out += ": " + detail;
#endif
  return out;
}
}  // namespace mgpu::cuda_detail

#define MGPU_CUDA_CHECK(expr)                                                               \
  do {                                                                                      \
    const cudaError_t mgpu_cuda_error_ = (expr);                                            \
    if (mgpu_cuda_error_ != cudaSuccess) {                                                  \
      std::string mgpu_cuda_message_ =                                                      \
          ::mgpu::cuda_detail::error_message(mgpu_cuda_error_, #expr, __FILE__, __LINE__);  \
      /* Clears the error it reports: the next launch check must not find it again and */  \
      /* blame its own kernel. */                                                           \
      static_cast<void>(cudaGetLastError());                                                \
      throw MGPU_CUDA_ERROR_TYPE(mgpu_cuda_message_);                                       \
    }                                                                                       \
  } while (0)
// After a launch: a bad configuration (and, emulated, any failure of the kernel) shows here.
#define MGPU_CUDA_CHECK_LAUNCH() MGPU_CUDA_CHECK(cudaGetLastError())
