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
void allreduce(const std::vector<std::vector<Tensor>>& data);

}  // namespace mgpu::comm
