// cpp/comm/bucket_allreduce.h -- the gradient all-reduce of a data-parallel step: buckets of each
// replica's flat gradient buffer summed over every replica (this process's devices and, under
// mpirun, every rank's) as backward produces them. The step says when a bucket is ready; this
// picks how it is summed: CPU devices' threads, GPU peer copies or NCCL, then MPI across ranks.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"

namespace mgpu::comm {

struct BucketPaths;

class BucketAllReduce {
 public:
  // devices: one replica each (distinct, one kind, already checked by the step); bucket_sizes:
  // the floats in each bucket; tag: labels the collectives across ranks (the batch geometry);
  // wire: the dtype the gradients travel in (the step's comm_dtype, see the .cpp).
  BucketAllReduce(const std::vector<Device>& devices, const std::vector<int64_t>& bucket_sizes,
                  int64_t tag, DType wire = DType::F32);
  // Releases the devices of buckets not every device joined and, after a step that failed
  // before its last bucket, joins the reductions it started (see the .cpp).
  ~BucketAllReduce();
  // Device d's bucket b (1-D float32 view on devices[d], written by work already enqueued) is
  // ready. Every device calls this for every bucket in bucket order; the sum is enqueued on the
  // devices' queues once every device has called it, so later work on a queue sees the sum.
  void ready(size_t b, size_t d, const Tensor& bucket);

 private:
  std::vector<Device> devices_;
  std::vector<int64_t> sizes_;
  int64_t tag_;
  DType wire_;
  bool cross_;                               // other ranks take part (mpirun)
  std::vector<std::vector<Tensor>> joined_;  // joined_[b][d]
  std::vector<size_t> count_;                // devices that have called ready() for bucket b
  std::vector<int> last_part_;               // [d]: the last bucket whose GPU part d enqueued
  size_t parts(size_t b) const;              // devices that enqueued their part of bucket b
  std::unique_ptr<BucketPaths> gpu_;         // the GPU collectives, one per bucket
};

}  // namespace mgpu::comm
