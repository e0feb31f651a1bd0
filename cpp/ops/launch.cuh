// cpp/ops/launch.cuh -- what every op's .cu file includes: the CUDA runtime or the emulator
// (cuda/runtime.cuh, failures thrown as mgpu::DeviceError), the launchers' argument checks, and the
// grid-stride kernel behind cuda::for_each_index (dispatch.h), which op.cu files instantiate for
// their per-element bodies. Included only by .cu files (nvcc, or g++ with MGPU_CUDA_EMULATION).
#pragma once

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/error.h"
#define MGPU_CUDA_ERROR_TYPE ::mgpu::DeviceError
#include "cuda/runtime.cuh"
#include "ops/dispatch.h"

namespace mgpu::ops::cuda::detail {

// Kernels index with int (half the registers and integer work of int64 on a GPU); launchers
// refuse counts that do not fit, naming the kernel and the count.
inline int as_int(const char* op, const char* what, int64_t value) {
  if (value < 0 || value > INT_MAX) {
    throw std::invalid_argument(std::string(op) + ": " + what + " = " + std::to_string(value) +
                                " does not fit the CUDA kernels' int indexing (0 to " +
                                std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(value);
}

inline void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(op) + ": " + what);
}

// a / b rounded up, for a >= 0 and b > 0, without forming a + b - 1 (which overflows an int once
// a is within b of 2^31).
__host__ __device__ inline int ceil_div(int a, int b) { return a / b + (a % b != 0 ? 1 : 0); }

// The blocks of `per_block` items each that cover `count` items (a grid's x extent), computed in
// 64 bits; refuses, naming the op, a count past int indexing or a grid past CUDA's 2^31 - 1
// blocks. Kernels launched with it compute blockIdx.x * per_block + t in 64 bits before they
// compare it with the count: in int that index passes 2^31 in the last block of a count near it.
inline unsigned grid_blocks(const char* op, int64_t count, int64_t per_block) {
  as_int(op, "the item count", count);
  const int64_t blocks = count / per_block + (count % per_block != 0 ? 1 : 0);
  if (per_block < 1 || blocks > INT_MAX) {
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(count) + " items in "
                                "blocks of " + std::to_string(per_block) + " need more than "
                                "2^31 - 1 blocks, CUDA's grid limit");
  }
  return static_cast<unsigned>(blocks);
}

// Grid-stride loops: a bounded grid covers any n, each thread taking i, i + grid size, ... Every
// such loop counts in 64 bits (`for (int64_t i = grid_index(); i < n; i += grid_stride())`): with
// an int counter, i + stride overflows once n is within one stride of 2^31, even where n itself
// fits an int.
__device__ inline int64_t grid_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t grid_stride() { return static_cast<int64_t>(blockDim.x) * gridDim.x; }

template <class Body>
__global__ void elementwise_kernel(int64_t n, Body body) {
  for (int64_t i = grid_index(); i < n; i += grid_stride()) body(i);
}

constexpr int kElementThreads = 256;
// Enough blocks to fill a large GPU several times over; more would only add scheduling.
constexpr int64_t kMaxElementBlocks = 4096;

}  // namespace mgpu::ops::cuda::detail

namespace mgpu::ops::cuda {

template <class Body>
void for_each_index(int64_t n, const Body& body, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t wanted = (n + detail::kElementThreads - 1) / detail::kElementThreads;
  const int blocks =
      static_cast<int>(wanted < detail::kMaxElementBlocks ? wanted : detail::kMaxElementBlocks);
  auto* kernel = detail::elementwise_kernel<Body>;
  MGPU_LAUNCH(kernel, blocks, detail::kElementThreads, 0, stream)(n, body);
  MGPU_CUDA_CHECK_LAUNCH();
}

}  // namespace mgpu::ops::cuda
