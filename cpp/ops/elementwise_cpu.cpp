// cpp/ops/elementwise_cpu.cpp -- sum_to_shape's CPU kernel: the row sums of dy (n, m) into db (m),
// the gradient of a bias broadcast over n rows.
#include <algorithm>

#include "ops/cpu_isa.h"
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

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
