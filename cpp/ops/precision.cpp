// cpp/ops/precision.cpp -- the names of the matrix products' precisions (ops/precision.h).
#include "ops/precision.h"

#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/bf16_gpu.h"
#include "ops/cpu_isa.h"
#include "ops/dispatch.h"

namespace mgpu::ops {

Precision parse_precision(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "f32") return Precision::F32;
  if (name == "bf16" || name == "bfloat16") return Precision::BF16;
  MGPU_CHECK_VALUE(false, "precision '", name, "' is not known; use 'float32' (every product in "
                   "float32) or 'bf16' (bfloat16 operands, float32 sums)");
  return Precision::F32;
}

const char* precision_name(Precision p) { return p == Precision::BF16 ? "bf16" : "float32"; }

}  // namespace mgpu::ops

namespace mgpu::ops {

Tensor bf16_round(const Tensor& x) {
  const char* op = "bf16_round";
  require_dtype(op, "x", x, DType::F32);
  Tensor y = Tensor::empty_like(x);
  const float* xp = x.f32();
  float* yp = y.f32();
  const int64_t n = x.numel();
  dispatch(x.device(), op,
           [=] {
             std::vector<uint16_t> bits(static_cast<size_t>(n));
             cpu::bf16_round(n, xp, bits.data());
             for (int64_t i = 0; i < n; ++i) {
               const uint32_t u = static_cast<uint32_t>(bits[static_cast<size_t>(i)]) << 16;
               std::memcpy(yp + i, &u, sizeof u);
             }
           },
           [=](cudaStream_t stream) { cuda::bf16_round_to_float(n, xp, yp, stream); }, x, y);
  return y;
}

std::string bf16_kernel() {
  if (cpu::active_isa() == cpu::Isa::AVX2) return "avx2";
  return cpu::bf16_hardware_dot() ? "avx512_bf16" : "avx512";
}

}  // namespace mgpu::ops
