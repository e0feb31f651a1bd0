// cpp/ops/elementwise.cu -- the per-element bodies of elementwise.h as CUDA grid-stride kernels:
// a op b (equal shapes, broadcast rows, scalar) for every BinaryOp, fills and the SGD step.
// Executed on emulated GPUs in tests; compiled by nvcc.
#include "ops/elementwise.h"
#include "ops/kernels_cuda_impl.cuh"

namespace mgpu::ops::cuda {

template void for_each_index<FillOut>(int64_t, const FillOut&, cudaStream_t);
template void for_each_index<SgdUpdate>(int64_t, const SgdUpdate&, cudaStream_t);

#define MGPU_INSTANTIATE_BINARY(op)                                                         \
  template void for_each_index<BinaryOut<op>>(int64_t, const BinaryOut<op>&, cudaStream_t); \
  template void for_each_index<BinarySameOut<op>>(int64_t, const BinarySameOut<op>&,        \
                                                  cudaStream_t);                            \
  template void for_each_index<BinaryScalarOut<op>>(int64_t, const BinaryScalarOut<op>&,    \
                                                    cudaStream_t);
MGPU_INSTANTIATE_BINARY(BinaryOp::Add)
MGPU_INSTANTIATE_BINARY(BinaryOp::Sub)
MGPU_INSTANTIATE_BINARY(BinaryOp::Mul)
MGPU_INSTANTIATE_BINARY(BinaryOp::Div)
#undef MGPU_INSTANTIATE_BINARY

}  // namespace mgpu::ops::cuda
