// cpp/ops/dropout.cu -- dropout's masked product (dropout.h) as a CUDA grid-stride kernel: one
// thread per Philox block of four elements of a row. Executed on emulated GPUs in tests; compiled
// by nvcc.
#include "ops/launch.cuh"
#include "ops/dropout.h"

namespace mgpu::ops::cuda {

template void for_each_index<DropoutMasked>(int64_t, const DropoutMasked&, cudaStream_t);

}  // namespace mgpu::ops::cuda
