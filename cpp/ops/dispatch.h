// cpp/ops/dispatch.h -- how an op's work reaches a device. dispatch() enqueues an op's CPU kernel
// on a CPU device's worker, or its CUDA launcher on a GPU's compute stream; for_each_index runs a
// per-element body (a struct with `MGPU_HD void operator()(int64_t i) const`) either way. Every
// op's .cpp goes through these two, so no op file needs an #if for the build flavour.
#pragma once

#include <cstdint>
#include <utility>

#include "core/gpu.h"
#include "core/parallel.h"
#include "core/tensor.h"

#if defined(__CUDACC__)
#define MGPU_HD __host__ __device__
#else
#define MGPU_HD
#endif

namespace mgpu::ops {

// True where GPU devices can exist (real CUDA or the emulator).
inline constexpr bool kGpuBuild = MGPU_GPU_BUILD;

// Enqueues the op `name` on the device's queue, `keep` (the tensors whose memory it touches)
// alive until it has run: cpu_fn() on a CPU device, gpu_fn(stream) on a GPU, with the GPU's
// compute stream (a CUDA launcher enqueues kernels there and returns). A build without GPUs never
// instantiates the GPU branch, so the launchers gpu_fn calls need no definition there.
template <typename CpuFn, typename GpuFn, typename... Keep>
void dispatch(Device device, const char* name, CpuFn&& cpu_fn, GpuFn&& gpu_fn,
              const Keep&... keep) {
  if constexpr (kGpuBuild) {
    if (!device.is_cpu()) {
      enqueue_on(device, name, [fn = std::forward<GpuFn>(gpu_fn), index = device.index]() mutable {
        fn(gpu::compute_stream(index));
      }, keep...);
      return;
    }
  }
  enqueue_on(device, name, std::forward<CpuFn>(cpu_fn), keep...);
}

// Elements per parallel block: large enough to amortise scheduling, small enough to spread
// a 100k-element gradient over two cores. Fixed, so nothing depends on the thread count.
constexpr int64_t kElementBlock = 1 << 14;

// Runs body(i) for i in [0, n) on the calling thread's share of cores, now.
template <typename Body>
void run_elements(int64_t n, const Body& body) {
  int64_t blocks = (n + kElementBlock - 1) / kElementBlock;
  if (blocks <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  parallel_for(blocks, [&](int64_t blk) {
    int64_t end = (blk + 1) * kElementBlock < n ? (blk + 1) * kElementBlock : n;
    for (int64_t i = blk * kElementBlock; i < end; ++i) body(i);
  });
}

namespace cuda {
// body(i) for i in [0, n) as a grid-stride kernel on `stream`, then a launch check. Defined in
// ops/launch.cuh; an op's .cu file instantiates it for each of the op's bodies.
template <class Body>
void for_each_index(int64_t n, const Body& body, cudaStream_t stream);
}  // namespace cuda

// Enqueues body over [0, n) on the device: a loop over fixed blocks on a CPU device's cores, the
// grid-stride kernel on a GPU.
template <typename Body, typename... Keep>
void for_each_index(const char* name, Device device, int64_t n, const Body& body,
                    const Keep&... keep) {
  if (n == 0) return;
  dispatch(device, name, [n, body] { run_elements(n, body); },
           [n, body](cudaStream_t stream) { cuda::for_each_index(n, body, stream); }, keep...);
}

}  // namespace mgpu::ops
