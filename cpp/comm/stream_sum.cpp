// cpp/comm/stream_sum.cpp -- stream_sum_gpu (stream_sum.h): the parts travel by peer copies
// issued on their owners' compute streams, into one inbox per device, and every device adds its
// inbox's rows in device order. Device j's stream: [its part is written] record ready(j) |
// wait ready(i), copy its part into inbox(i), for every i != j | record pushed(j) | wait
// pushed(i) for every i != j | sum the inbox into the part. No host thread waits on a GPU.
#include "comm/stream_sum.h"

#if MGPU_GPU_BUILD

#include <memory>
#include <mutex>
#include <utility>

#include "comm/barrier.h"
#include "core/gpu.h"
#include "core/queue.h"
#include "ops/elementwise.h"
#define MGPU_CUDA_ERROR_TYPE ::mgpu::DeviceError
#include "cuda/runtime.cuh"

namespace mgpu::comm {
namespace {

// A device's two events, made once by its worker and reused: the third barrier of every sum
// (below) comes after every wait on them was issued, so recording them again cannot move a
// point another stream has yet to wait for.
std::pair<cudaEvent_t, cudaEvent_t> sum_events(int device) {
  static cudaEvent_t ready[gpu::kMaxGpus] = {}, pushed[gpu::kMaxGpus] = {};
  static std::mutex made;
  std::lock_guard<std::mutex> lock(made);
  if (!ready[device]) {
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&ready[device], cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&pushed[device], cudaEventDisableTiming));
  }
  return {ready[device], pushed[device]};
}

struct StreamSum {
  std::vector<int> gpu;       // gpu[d]: the CUDA index of entry d
  std::vector<Tensor> parts;  // parts[d] on gpu[d]
  std::vector<Tensor> inbox;  // inbox[d]: k rows of n floats on gpu[d]; row j is parts[j]
  int64_t n = 0;
  Barrier barrier;
  explicit StreamSum(int k) : barrier(k) {}

  int k() const { return static_cast<int>(gpu.size()); }

  void run(int me) {
    try {
      const int dev = gpu[me];
      cudaStream_t s = gpu::compute_stream(dev);
      const size_t bytes = static_cast<size_t>(n) * sizeof(float);
      float* mine = parts[me].f32();
      float* in = inbox[me].f32();
      auto [ready, pushed] = sum_events(dev);
      gpu::copy_within(dev, in + me * n, mine, bytes);
      // The part is written and the inbox may be written into from here on.
      MGPU_CUDA_CHECK(cudaEventRecord(ready, s));
      barrier.arrive_and_wait();
      for (int j = 0; j < k(); ++j) {
        if (j == me) continue;
        MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, sum_events(gpu[j]).first, 0));
        MGPU_CUDA_CHECK(
            cudaMemcpyPeerAsync(inbox[j].f32() + me * n, gpu[j], mine, dev, bytes, s));
      }
      MGPU_CUDA_CHECK(cudaEventRecord(pushed, s));
      barrier.arrive_and_wait();
      for (int j = 0; j < k(); ++j)
        if (j != me) MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, sum_events(gpu[j]).second, 0));
      barrier.arrive_and_wait();  // every wait on this sum's events is issued
      // In device order, as the emulated NCCL and the peer-copy all-reduce add.
      gpu::copy_within(dev, mine, in, bytes);
      for (int j = 1; j < k(); ++j)
        ops::cuda::for_each_index(n, ops::BinarySameOut<ops::BinaryOp::Add>{mine, in + j * n, mine},
                                  s);
    } catch (...) {
      barrier.abort();  // release the devices waiting for this one
      throw;
    }
  }
};

}  // namespace

void stream_sum_gpu(const std::vector<Tensor>& parts, const std::vector<Device>& devices) {
  const int k = static_cast<int>(devices.size());
  MGPU_ASSERT(k >= 2 && parts.size() == devices.size(), "stream_sum_gpu: ", parts.size(),
              " parts for ", k, " devices");
  auto sum = std::make_shared<StreamSum>(k);
  sum->n = parts[0].numel();
  for (int d = 0; d < k; ++d) {
    const Tensor& p = parts[static_cast<size_t>(d)];
    MGPU_ASSERT(!devices[d].is_cpu() && p.device() == devices[d] && p.dtype() == DType::F32 &&
                p.numel() == sum->n, "stream_sum_gpu: part ", d, " is not a float32 tensor of ",
                sum->n, " on ", devices[d]);
    sum->gpu.push_back(devices[d].index);
    sum->parts.push_back(p);
    sum->inbox.push_back(Tensor::empty({k * sum->n}, DType::F32, devices[d]));
  }
  if (sum->n == 0) return;
  // Every queue gets its part in the same host order, so the barriers cannot deadlock.
  std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
  int d = 0;
  try {
    for (; d < k; ++d)
      enqueue_on(devices[d], "allreduce on streams", [sum, d] { sum->run(d); }, sum->parts[d]);
  } catch (...) {
    if (d > 0) sum->barrier.abort();  // the devices that got their part must not wait for ever
    throw;
  }
}

}  // namespace mgpu::comm

#else

#include "core/error.h"

namespace mgpu::comm {
void stream_sum_gpu(const std::vector<Tensor>&, const std::vector<Device>&) {
  throw InternalError("internal error: stream_sum_gpu was called in a build without GPUs");
}
}  // namespace mgpu::comm

#endif  // MGPU_GPU_BUILD
