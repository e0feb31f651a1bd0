// cpp/ops/linear_cpu.cpp -- the row-wise kernels around linear's matmul (which is sgemm, gemm.h):
// the bias gradient over dy (n, m) into db (m), and argmax over x (n, m) -> (n).
// n is the batch, m the features (LeNet: 128 hidden units, 10 classes).
#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "ops/cpu_isa.h"
#include "ops/kernels_cpu.h"

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

void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * m;
    int64_t best = 0;
    if (!std::isnan(row[0])) {
      for (int64_t j = 1; j < m; ++j) {
        if (std::isnan(row[j])) {
          best = j;
          break;
        }
        if (row[j] > row[best]) best = j;  // strict: the first maximum wins ties
      }
    }
    out[i] = best;
  }
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
