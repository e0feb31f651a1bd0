// tests/cpp/emu_test_util.h -- helpers shared by the tests that run CUDA code on emulated GPUs.
#pragma once

#include <cstddef>
#include <vector>

#include "cuda/runtime.cuh"

namespace mgpu_test {

// Device memory holding a copy of a host vector; frees itself. Zero elements still allocate one,
// so a kernel may be handed a valid pointer for an empty shape.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : n_(n) {
    MGPU_CUDA_CHECK(cudaMalloc(&p_, (n > 0 ? n : 1) * sizeof(T)));
  }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) {
    MGPU_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceVector() { cudaFree(p_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return p_; }
  size_t bytes() const { return n_ * sizeof(T); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    MGPU_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

// A kernel argument (tests/cpp/emu_kernels.cu's scale_if) laid out as mgpu's scalar ops' functors:
// 4 bytes of padding after `s`, 7 after `scale`; what the caller's memory held there travels
// with the struct.
struct ScaleIf {
  const float* x;
  float s;
  float* y;
  bool scale;
};

}  // namespace mgpu_test
