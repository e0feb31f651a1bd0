// cpp/comm/bucket_allreduce.cpp -- picking the reduction path for each bucket of gradients.
//   - GPUs of one process: a GpuAllReduce per bucket (allreduce_gpu.h) that each device joins on
//     its own queue as soon as its backward has produced the bucket; every bucket but the last
//     leaves the compute stream free to go on (NCCL), the last one makes it wait for all.
//   - CPU devices: comm::allreduce once the last device has joined (their queues are the worker
//     threads backward also runs on, so starting earlier would gain nothing).
//   - Across ranks (mpirun): device 0's sum is summed with the other ranks' (dist::allreduce, in
//     rank order) and copied to this process's other devices. With several GPUs per process
//     that sum is read on device 0's compute stream and the copies write the others' compute
//     streams, so every bucket's local part ends with a join of the compute stream (kJoin), not
//     on the communication stream; and its parts are enqueued on every device together, once
//     the last device is ready, right before the cross-rank sum and the copies: a copy between
//     two GPUs makes one device's queue wait for the other's, so a part joined earlier (device 0
//     joining bucket 1 before device 1 has joined bucket 0) would wait at its barrier for a
//     device whose queue waits for it.
// Every path adds in device order, then rank order, so bucketing never changes the bits.
//
// wire BF16 (comm_dtype='bf16'): every bucket travels in bfloat16, half the bytes (counted so):
// each device's float32 bucket is rounded to bfloat16 (dtype.h's rounding, nearest even) on its
// own queue before it leaves; the sum of the devices' rounded values is added in float32 in
// device order and rounded to bfloat16 once (allreduce.h's wire: CPU devices' threads, GPUs'
// peer copies; NCCL's ncclBfloat16 sums on GPUs, allreduce_gpu.h); across ranks, device 0's
// (bfloat16-valued) sum is summed with the other ranks' the same way in rank order
// (dist::allreduce's wire; GPUs on NCCL: its ncclBfloat16 sums), so with one device per rank the
// sum is that of every device's rounded gradients in rank order, rounded once; with several,
// each process's sum is rounded before the ranks add them. Every bucket ends widened to float32
// (exact) in the replicas' gradients, and the optimizer updates the float32 parameters with it.
// Bucketing still never changes the bits: each element is rounded and summed on its own.
#include "comm/bucket_allreduce.h"

#include "comm/allreduce.h"
#include "comm/allreduce_gpu.h"
#include "comm/allreduce_mpi.h"
#include "comm/collective_counts.h"
#include "ops/elementwise.h"

namespace mgpu::comm {

struct BucketPaths {
#if MGPU_GPU_BUILD
  std::vector<std::unique_ptr<GpuAllReduce>> buckets;
#endif
};

BucketAllReduce::BucketAllReduce(const std::vector<Device>& devices,
                                 const std::vector<int64_t>& bucket_sizes, int64_t tag,
                                 DType wire)
    : devices_(devices), sizes_(bucket_sizes), tag_(tag), wire_(wire),
      cross_(dist::world_size() > 1),
      joined_(bucket_sizes.size(), std::vector<Tensor>(devices.size())),
      count_(bucket_sizes.size(), 0), last_part_(devices.size(), -1),
      gpu_(std::make_unique<BucketPaths>()) {
#if MGPU_GPU_BUILD
  if (devices.size() > 1 && !devices[0].is_cpu()) {
    for (size_t b = 0; b < sizes_.size(); ++b) {
      const bool last = b + 1 == sizes_.size();
      const Finish finish = last ? Finish::kWait : cross_ ? Finish::kJoin : Finish::kOnComm;
      gpu_->buckets.push_back(std::make_unique<GpuAllReduce>(
          devices, std::vector<Shape>{{sizes_[b]}}, finish,
          b ? gpu_->buckets.back().get() : nullptr, wire));
    }
  }
#endif
}

// A step that failed while being enqueued leaves buckets some devices joined: their GPU parts
// would wait for the others forever, so they are released (with an error on those queues). And
// unless the last bucket ran (its end covers every earlier one), the reductions left on the
// communication streams are joined: each device's compute stream waits for them before anything
// it runs next (the next step's backward, which writes the same gradients) and before the
// buckets' flat buffers go back to the cache.
BucketAllReduce::~BucketAllReduce() {
#if MGPU_GPU_BUILD
  const size_t k = devices_.size(), n = gpu_->buckets.size();
  if (n == 0) return;
  try {
    for (size_t b = 0; b < n; ++b)
      if (parts(b) > 0 && parts(b) < k) gpu_->buckets[b]->abort();
    if (parts(n - 1) == k) return;
    for (size_t d = 0; d < k; ++d)
      if (last_part_[d] >= 0) gpu_->buckets[static_cast<size_t>(last_part_[d])]->join_compute(d);
  } catch (...) {  // a destructor never throws; nothing more can be enqueued (out of memory)
  }
#endif
}

size_t BucketAllReduce::parts(size_t b) const {
  size_t joined = 0;
  for (int p : last_part_)
    if (p >= static_cast<int>(b)) ++joined;
  return joined;
}

void BucketAllReduce::ready(size_t b, size_t d, const Tensor& bucket) {
  MGPU_ASSERT(b < sizes_.size() && d < devices_.size() && !joined_[b][d].defined() &&
              bucket.numel() == sizes_[b], "bucket ", b, " of device ", d, " joins twice or "
              "has the wrong size");
  joined_[b][d] = bucket;
  const size_t k = devices_.size();
#if MGPU_GPU_BUILD
  const bool gpus = !gpu_->buckets.empty();
  auto part = [&](size_t i) {
    gpu_->buckets[b]->join(i, {joined_[b][i]});
    last_part_[i] = static_cast<int>(b);
  };
  if (gpus && !cross_) part(d);
#endif
  if (++count_[b] < k) return;
  count_collective(sizes_[b] * static_cast<int64_t>(dtype_size(wire_)));
#if MGPU_GPU_BUILD
  if (gpus && cross_)
    for (size_t i = 0; i < k; ++i) part(i);
#endif
  if (k > 1 && devices_[0].is_cpu()) {
    std::vector<std::vector<Tensor>> data;
    for (const Tensor& t : joined_[b]) data.push_back({t});
    allreduce(data, wire_);
  }
  if (cross_) {
    dist::allreduce({joined_[b][0]}, dist::Op::TrainStep, tag_, wire_);
    for (size_t i = 1; i < k; ++i) ops::copy(joined_[b][i], joined_[b][0]);
  }
}

}  // namespace mgpu::comm
