// cpp/comm/allreduce.h -- in-place sum of tensors that live on different devices (sec. 12.5.4).
// data[d] holds device d's tensors (the same list of shapes on every device); afterwards every
// device holds the element-wise sum. The list is reduced as one flat buffer, so a whole set of
// gradients costs one collective, not one per parameter.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace mgpu::comm {

// Sums data[0][j] + data[1][j] + ... for every j, in place on every device. Checks: at least one
// device, one device per entry (distinct), equal shapes and float32. Summation order is fixed --
// device 0's value first, then 1, 2, ... -- so every device ends with bitwise the same result.
//
// wire is the dtype the values travel in between devices. DType::BF16 (a step's comm_dtype) moves
// half the bytes: each device rounds its own float32 values to bfloat16 (dtype.h's rounding,
// nearest even) before any other device reads them; each sum adds those bfloat16 values,
// widened, in float32 in device order and is rounded to bfloat16 once more (the all-gather
// carries bfloat16); every device then holds that sum widened to float32 (exact). GPUs: the
// peer-copy path sums so too; the NCCL path's sums are NCCL's ncclBfloat16 (allreduce_gpu.h).
void allreduce(const std::vector<std::vector<Tensor>>& data, DType wire = DType::F32);

}  // namespace mgpu::comm
