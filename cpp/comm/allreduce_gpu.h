// cpp/comm/allreduce_gpu.h -- the all-reduce of allreduce.h when every entry lives on a GPU:
// NCCL where it was built (real CUDA), else our reduce-scatter + all-gather over peer copies, whose
// sums are added in device order exactly as the CPU devices' all-reduce adds them.
// MGPU_ALLREDUCE=peer selects our path in a build with NCCL. Only in GPU builds (MGPU_GPU_BUILD).
#pragma once

#include <vector>

#include "core/gpu.h"
#include "core/tensor.h"

namespace mgpu::comm {

// data and devices already checked by comm::allreduce: k >= 2 distinct GPUs, equal float32 lists.
void allreduce_gpu(const std::vector<std::vector<Tensor>>& data,
                   const std::vector<Device>& devices);

}  // namespace mgpu::comm
