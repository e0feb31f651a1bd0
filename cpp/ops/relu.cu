// cpp/ops/relu.cu -- relu's per-element bodies (relu.h) as CUDA grid-stride kernels: y = max(x, 0)
// and dx = x > 0 ? dy : 0 over (n,). Executed on emulated GPUs in tests; compiled by nvcc.
#include "ops/launch.cuh"
#include "ops/relu.h"

namespace mgpu::ops::cuda {

template void for_each_index<ReluOut>(int64_t, const ReluOut&, cudaStream_t);
template void for_each_index<ReluGradInput>(int64_t, const ReluGradInput&, cudaStream_t);

}  // namespace mgpu::ops::cuda
