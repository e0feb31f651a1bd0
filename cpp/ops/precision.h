// cpp/ops/precision.h -- the arithmetic of a matrix product (linear's mm, conv2d's passes):
// float32 throughout, or bfloat16 operands with float32 sums (ops/bf16.h says where bfloat16
// enters and what the bf16 products promise). Inputs and outputs are float32 tensors either way.
#pragma once

#include <string>

namespace mgpu {
class Tensor;
}

namespace mgpu::ops {

enum class Precision { F32, BF16 };

// "float32" (or "fp32", "f32") and "bf16" (or "bfloat16"); anything else raises ValueError naming
// the choices. precision_name gives the canonical name back.
Precision parse_precision(const std::string& name);
const char* precision_name(Precision p);

// A float32 tensor holding x rounded to bfloat16 exactly as the bf16 products round their
// operands (ops/bf16.h, ops/bf16_gpu.h).
Tensor bf16_round(const Tensor& x);

// The kernel the bf16 products run on this CPU: "avx512_bf16", "avx512" or "avx2".
std::string bf16_kernel();

}  // namespace mgpu::ops
