// cpp/comm/allreduce_gpu.h -- the all-reduce of allreduce.h when every entry lives on a GPU:
// NCCL where it was built (real CUDA), else our reduce-scatter + all-gather over peer copies, whose
// sums are added in device order exactly as the CPU devices' all-reduce adds them.
// MGPU_ALLREDUCE=peer selects our path in a build with NCCL. Only in GPU builds (MGPU_GPU_BUILD).
#pragma once

#include <memory>
#include <vector>

#include "core/gpu.h"
#include "core/tensor.h"

namespace mgpu::comm {

// data and devices already checked by comm::allreduce: k >= 2 distinct GPUs, equal float32 lists;
// wire as allreduce.h's.
void allreduce_gpu(const std::vector<std::vector<Tensor>>& data,
                   const std::vector<Device>& devices, DType wire = DType::F32);

struct GpuCollective;

// One all-reduce whose devices join one at a time, so a step can start reducing a bucket of
// gradients on each device as soon as that device's backward has produced it: made by the host for
// k distinct GPUs and the shapes every device will pass, then join(d, tensors) enqueues device d's
// part on its queue. The parts meet on the devices; every device must join, in the same order
// relative to other collectives on every queue (the host's program order gives that).
//
// Where a device's part leaves the result (the NCCL path; the peer-copy path always finishes in
// place on the compute stream):
//   kWait   -- the compute stream waits for the reduction and for everything earlier on the
//              communication stream, and the device's worker waits for it to finish under the
//              watchdog, so a failed or hung collective is an error of this task: a step's last
//              collective, and every stand-alone all-reduce;
//   kJoin   -- the compute stream waits for it (an event, no host wait): the result is read on
//              the compute stream next (a cross-rank sum of a bucket);
//   kOnComm -- it stays on the communication stream, so the compute stream goes on (backward)
//              while it runs: a later kWait or kJoin collective made with `earlier` pointing
//              here makes the compute stream wait for both and keeps this one's buffers alive
//              until then, or join_compute() does (a step that failed before that one).
enum class Finish { kWait, kJoin, kOnComm };

//
// wire BF16: the packed flat buffer is bfloat16, so half the bytes move. Device d's part rounds
// its float32 tensors into it on its compute stream (dtype.h's rounding, nearest even:
// ops::cuda::convert). NCCL sums it as ncclBfloat16 (the emulator: widened, float32 sums in
// device order, rounded to bfloat16 once; real NCCL: its own order, rounding each partial sum)
// and the unpack widens the sum into the float32 tensors on the communication stream, where the
// float32 unpack copies it; the peer-copy path sums as the CPU devices do (allreduce.h), bit for
// bit, and widens on the compute stream.
class GpuAllReduce {
 public:
  GpuAllReduce(const std::vector<Device>& devices, const std::vector<Shape>& shapes,
               Finish finish = Finish::kWait, const GpuAllReduce* earlier = nullptr,
               DType wire = DType::F32);
  void join(size_t d, const std::vector<Tensor>& tensors);
  // Enqueues on device d's queue, after its part: the compute stream waits for everything on the
  // communication stream so far (this collective's reduction and unpack included), and the
  // collective's buffers stay alive until then. For a kOnComm collective no later collective
  // will cover (its step failed): its late unpack then cannot overwrite the gradients of the
  // next step, and its flat buffers go back to the cache only in the compute stream's order.
  void join_compute(size_t d) const;
  // Releases the devices that joined with an error: a device that will never join (its step
  // failed while being enqueued) must not leave the others waiting at a barrier forever.
  void abort();

 private:
  std::shared_ptr<GpuCollective> coll_;
  std::vector<Shape> shapes_;
};

// The in-process NCCL communicator sets: live (made, not yet freed), kept by the cache (at most
// a few, most recently used), and launches NCCL refused (one on an aborted set would be one).
struct NcclStats {
  int live_sets = 0;
  int cached_sets = 0;
  int64_t refused_launches = 0;
};
NcclStats nccl_stats();
// Frees the cached communicator sets no collective holds now (mgpu.empty_cache() calls it after
// waiting for the devices): each holds GPU memory outside the allocator's statistics.
void empty_communicators();
// Tests only: every NCCL launch first sleeps this long (0: not at all).
void set_nccl_launch_pause(double seconds);

}  // namespace mgpu::comm
