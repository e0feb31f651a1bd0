// cpp/ops/launch.h -- how a per-element body runs on a device.
// A body is a small struct with `MGPU_HD void operator()(int64_t i) const`. for_each_index
// enqueues it on the device's queue: on a CPU device a loop split over the device's cores in
// fixed blocks; on a GPU a grid-stride kernel on the device's compute stream.
#pragma once

#include <cstdint>

#include "core/gpu.h"
#include "core/parallel.h"
#include "core/tensor.h"
#if MGPU_GPU_BUILD && !defined(__CUDACC__)
#include "ops/kernels_cuda.h"
#endif

#if defined(__CUDACC__)
#define MGPU_HD __host__ __device__
#else
#define MGPU_HD
#endif

namespace mgpu::ops {

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

// Enqueues body over [0, n) on the device; `keep` are the tensors whose memory it touches.
#if MGPU_GPU_BUILD && !defined(__CUDACC__)
// Enqueues fn(stream) on a GPU's queue: fn launches kernels on the GPU's compute stream.
template <typename Fn, typename... Keep>
void enqueue_gpu(Device device, const char* name, Fn&& fn, const Keep&... keep) {
  enqueue_on(device, name, [fn = std::forward<Fn>(fn), index = device.index]() mutable {
    fn(gpu::compute_stream(index));
  }, keep...);
}
#endif

template <typename Body, typename... Keep>
void for_each_index(const char* name, Device device, int64_t n, const Body& body,
                    const Keep&... keep) {
  if (n == 0) return;
#if MGPU_GPU_BUILD && !defined(__CUDACC__)
  if (!device.is_cpu()) {
    // The body's grid-stride kernel is instantiated in an ops/*.cu file (kernels_cuda.h).
    enqueue_gpu(device, name, [n, body](cudaStream_t s) { cuda::for_each_index(n, body, s); },
                keep...);
    return;
  }
#endif
  enqueue_on(device, name, [n, body] { run_elements(n, body); }, keep...);
}

}  // namespace mgpu::ops
