// cpp/ops/elementwise_cpu.cpp -- elementwise CPU kernels compiled per instruction-set path:
// sum_to_shape's row sums of dy (n, m) into db (m), the same-shape add (ResNet's residual
// connections, gradient accumulation) and the SGD step.
#include <algorithm>

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/elementwise.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db) {
  // Row by row, so each db[j] adds dy[0, j], dy[1, j], ... in i order (the documented order of
  // the batch sum) while the loop over j vectorizes.
  float* __restrict out = db;
  std::fill(out, out + m, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict row = dy + i * m;
    for (int64_t j = 0; j < m; ++j) out[j] += row[j];
  }
}

void add_elements(int64_t n, const float* a, const float* b, float* out) {
  // out may be a or b (in-place add): element i reads a[i], b[i] before it writes out[i].
  run_elements(n, [=](int64_t i) { out[i] = a[i] + b[i]; });
}

void sgd_step(int64_t n, float* param, const float* grad, float scale) {
  run_elements(n, [=](int64_t i) { param[i] -= scale * grad[i]; });
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
