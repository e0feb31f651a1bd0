// tests/cpp/cuda_kernels_test_util.h -- helpers shared by the tests of the ops' CUDA kernels on
// emulated GPUs (emu_test_kernels_cuda.cpp, emu_test_kernels_cuda_elementwise.cpp): seeded data,
// the tolerance table, the element-wise comparison, and the fixture that gives each test a stream.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/runtime.cuh"

namespace mgpu_test {

using Floats = std::vector<float>;

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline Floats random_floats(size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Floats v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Sums: rel 1e-4, abs 1e-5 (the GPU adds in another order than the CPU). Elementwise: exact.
struct Tolerance {
  double rel, abs;
};
inline constexpr Tolerance kSum{1e-4, 1e-5};
inline constexpr Tolerance kExact{0.0, 0.0};

// Compares element by element (NaN equals NaN); on failure names the worst index.
inline ::testing::AssertionResult close(const std::string& what, const Floats& got,
                                        const Floats& want, Tolerance tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " elements, want " << want.size();
  }
  size_t bad = 0, worst = 0;
  double worst_err = -1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const bool ok = err <= tol.abs + tol.rel * std::fabs(static_cast<double>(want[i]));
    if (!ok || std::isnan(err)) {
      ++bad;
      if (std::isnan(err) || err > worst_err) {
        worst_err = std::isnan(err) ? INFINITY : err;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements differ; worst at index "
         << worst << ": got " << got[worst] << ", want " << want[worst];
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    mgpu::emu::reset_from_env();  // MGPU_EMU_SEED decides the fiber order
    MGPU_CUDA_CHECK(cudaSetDevice(0));
    MGPU_CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    cudaStreamDestroy(stream_);
    cudaGetLastError();
    mgpu::emu::reset_from_env();
  }
  void sync() { MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  cudaStream_t stream_ = nullptr;
};

}  // namespace mgpu_test
