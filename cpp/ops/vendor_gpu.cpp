// cpp/ops/vendor_gpu.cpp -- MGPU_GEMM and MGPU_CONV: which code runs a GPU's products and convs.
#include "ops/vendor_gpu.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace mgpu::ops {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

GemmPath read_gemm() {
  std::string v = env("MGPU_GEMM");
  if (v.empty()) return kCublas ? GemmPath::Cublas : GemmPath::Native;
  if (v == "native") return GemmPath::Native;
  MGPU_CHECK_VALUE(v == "cublas", "MGPU_GEMM=", v, " is not understood; use MGPU_GEMM=cublas "
                   "(NVIDIA's cuBLAS) or MGPU_GEMM=native (mgpu's own kernel)");
  MGPU_CHECK_VALUE(kCublas, "MGPU_GEMM=cublas, but this build has no cuBLAS (",
                   MGPU_CUDA_EMULATION_BUILD ? "emulated GPUs cannot run it"
                                             : "it was built without CUDA",
                   "); unset MGPU_GEMM or set MGPU_GEMM=native");
  return GemmPath::Cublas;
}

ConvPath read_conv() {
  std::string v = env("MGPU_CONV");
  if (v.empty() || v == "native") return ConvPath::Native;
  MGPU_CHECK_VALUE(v == "cudnn", "MGPU_CONV=", v, " is not understood; use MGPU_CONV=native "
                   "(mgpu's own kernels) or MGPU_CONV=cudnn (NVIDIA's cuDNN)");
  MGPU_CHECK_VALUE(kCudnn, "MGPU_CONV=cudnn, but this build has no cuDNN (",
                   MGPU_CUDA_EMULATION_BUILD ? "emulated GPUs cannot run it"
                                             : "cudnn.h was not found when it was built",
                   "); unset MGPU_CONV or set MGPU_CONV=native");
  return ConvPath::Cudnn;
}

}  // namespace

// Not cached in a static: a bad value must raise on every op call, not once and then crash.
GemmPath gemm_path() { return read_gemm(); }
ConvPath conv_path() { return read_conv(); }

}  // namespace mgpu::ops
