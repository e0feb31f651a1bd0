// cpp/comm/stream_sum.h -- a small in-place all-reduce over the GPUs of one process that runs on
// their compute streams and never makes a host thread wait for a GPU: for values a step needs in
// the middle of its layers (synchronised batch norm's statistics, once per layer and direction),
// where waiting for the reduction on the host would stall every device's queue each time.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mgpu::comm {

// parts[d]: a 1-D float32 tensor on GPU devices[d] (k >= 2 distinct GPUs of this process, one
// size), written by work already enqueued on that device's queue. Enqueues on every device's
// queue: parts[d] = ((parts[0] + parts[1]) + parts[2]) + ... in device order, the order of the
// emulated NCCL and of the peer-copy all-reduce, so the sums are bitwise theirs. Each device
// copies its part into every other device's inbox on its own stream; the streams order the
// copies and the sums with events, and the devices' worker threads meet (three barriers) only so
// that an event is recorded before another stream waits on it. Only in GPU builds.
void stream_sum_gpu(const std::vector<Tensor>& parts, const std::vector<Device>& devices);

}  // namespace mgpu::comm
