// cpp/comm/shared_update.h -- the shared update of CPU replicas: CPU devices of one process share
// memory, so their gradient sum and the optimizer's update run as one collective after backward
// instead of a bucketed all-reduce (reduce-scatter, all-gather) followed by every replica
// updating all of its parameters; and the copy of batch norm's running statistics from the first
// replica to the others (share_first). The optimizer itself is the caller's (train/optimizer_step).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/barrier.h"
#include "core/tensor.h"

namespace mgpu::comm {

// MGPU_CPU_SHARED_UPDATE=0 (read at every step) keeps the bucketed all-reduce and the per-replica
// updates, for tests and benchmarks; anything else (or unset) turns the shared update on.
bool shared_update_enabled();

// The flat gradients are cut into blocks of ops::kElementBlock elements, device j of k takes the
// j-th of k runs of blocks, sums its blocks over the replicas, in device order as
// comm::allreduce adds, and calls `update` on each block with that sum, which applies the
// optimizer to those elements of every replica's parameters and state. With clipping (clip set)
// it first writes the sums into replica 0's gradients and each block's sum of squares
// (cpu::sum_squares, the blocks of cpu::sum_squares_blocks), meets the others, and adds the
// block sums in block order: the norm of ops::clip_factor, bit for bit, which `clip` turns into
// the factor `update` receives. Each element gets the same operations on the same values as in
// a per-replica update, so every replica's parameters keep their bits; the other replicas'
// gradient buffers are left unsummed (nothing reads them after the step). It saves the
// all-gather, each device's writes of the summed gradients, and all but one or two of the
// collectives' meetings (one device waiting for the other at each bucket).
struct SharedUpdate {
  explicit SharedUpdate(int k) : barrier(k) {}
  std::vector<float*> grads;  // grads[d]: replica d's flat gradients
  // Set (one per replica) to reduce in bfloat16: device d first rounds its own gradients into
  // grads16[d] (dtype.h's rounding), the block sums read those, half the bytes, add them in
  // float32 in device order and round each sum to bfloat16 once more, as an all-gather in
  // bfloat16 would carry it.
  std::vector<BFloat16*> grads16;
  int64_t total = 0;          // their length
  // update(f0, n, sum, clip): the optimizer on flat elements [f0, f0 + n) of every replica, with
  // the summed gradients sum[0, n) and the clip factor (null: none). Blocks run in parallel.
  std::function<void(int64_t, int64_t, const float*, const float*)> update;
  // Set for clipping: the clip factor of the summed gradients' sum of squares.
  std::function<float(double)> clip;
  std::vector<double> block_squares;  // with clipping: per block, its sum of squares
  Barrier barrier;

  // Device `me` of k: its run of blocks, between the meetings.
  void run(int me);
};

// Enqueues sh->run(d) on devices[d] for every d, in the same host order on every queue (see
// comm::allreduce); task d keeps keep[d] alive (its replica's tensors: the others' are kept by
// their tasks, which all leave the collective together). A part that fails releases the others.
void enqueue_shared_update(const std::shared_ptr<SharedUpdate>& sh,
                           const std::vector<Device>& devices,
                           const std::vector<std::vector<Tensor>>& keep, const char* name);

// Batch norm's running statistics are those of the first replica's shard (rank 0's under mpirun),
// as with PyTorch's DataParallel, and every replica keeps a copy of them: buffers[d] are replica
// d's; buffers[0] is broadcast from rank 0 across processes and copied into every other replica's.
void share_first(const std::vector<std::vector<Tensor>>& buffers);

}  // namespace mgpu::comm
