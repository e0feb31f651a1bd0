// cpp/comm/bucket_allreduce.cpp -- picking the reduction path for each bucket of gradients.
//   - GPUs of one process: a GpuAllReduce per bucket (allreduce_gpu.h) that each device joins on
//     its own queue as soon as its backward has produced the bucket; every bucket but the last
//     leaves the compute stream free to go on (NCCL), the last one makes it wait for all.
//   - CPU devices: comm::allreduce once the last device has joined (their queues are the worker
//     threads backward also runs on, so starting earlier would gain nothing).
//   - Across ranks (mpirun): device 0's sum is summed with the other ranks' (dist::allreduce, in
//     rank order) and copied to this process's other devices.
// Every path adds in device order, then rank order, so bucketing never changes the bits.
#include "comm/bucket_allreduce.h"

#include "comm/allreduce.h"
#include "comm/allreduce_gpu.h"
#include "comm/allreduce_mpi.h"
#include "ops/elementwise.h"

namespace mgpu::comm {

struct BucketPaths {
#if MGPU_GPU_BUILD
  std::vector<std::unique_ptr<GpuAllReduce>> buckets;
#endif
};

BucketAllReduce::BucketAllReduce(const std::vector<Device>& devices,
                                 const std::vector<int64_t>& bucket_sizes, int64_t tag)
    : devices_(devices), sizes_(bucket_sizes), tag_(tag),
      joined_(bucket_sizes.size(), std::vector<Tensor>(devices.size())),
      count_(bucket_sizes.size(), 0), gpu_(std::make_unique<BucketPaths>()) {
#if MGPU_GPU_BUILD
  if (devices.size() > 1 && !devices[0].is_cpu()) {
    for (size_t b = 0; b < sizes_.size(); ++b) {
      const bool last = b + 1 == sizes_.size();
      gpu_->buckets.push_back(std::make_unique<GpuAllReduce>(
          devices, std::vector<Shape>{{sizes_[b]}}, /*overlap=*/!last,
          b ? gpu_->buckets.back().get() : nullptr));
    }
  }
#endif
}

// A step that failed while being enqueued leaves buckets some devices joined: their GPU parts
// would wait for the others forever, so they are released (with an error on those queues).
BucketAllReduce::~BucketAllReduce() {
#if MGPU_GPU_BUILD
  for (size_t b = 0; b < gpu_->buckets.size(); ++b)
    if (count_[b] > 0 && count_[b] < devices_.size()) gpu_->buckets[b]->abort();
#endif
}

void BucketAllReduce::ready(size_t b, size_t d, const Tensor& bucket) {
  MGPU_ASSERT(b < sizes_.size() && d < devices_.size() && !joined_[b][d].defined() &&
              bucket.numel() == sizes_[b], "bucket ", b, " of device ", d, " joins twice or "
              "has the wrong size");
  joined_[b][d] = bucket;
  const size_t k = devices_.size();
#if MGPU_GPU_BUILD
  if (!gpu_->buckets.empty()) gpu_->buckets[b]->join(d, {bucket});
#endif
  if (++count_[b] < k) return;
  if (k > 1 && devices_[0].is_cpu()) {
    std::vector<std::vector<Tensor>> data;
    for (const Tensor& t : joined_[b]) data.push_back({t});
    allreduce(data);
  }
  if (dist::world_size() > 1) {
    dist::allreduce({joined_[b][0]}, dist::Op::TrainStep, tag_);
    for (size_t i = 1; i < k; ++i) ops::copy(joined_[b][i], joined_[b][0]);
  }
}

}  // namespace mgpu::comm
