// cpp/ops/argmax_cpu.cpp -- argmax over the rows of x (n, m) -> (n) on the CPU (LeNet: m = 10
// classes); the first maximum wins ties and the first NaN counts as the maximum, as in NumPy.
#include <cmath>

#include "ops/argmax.h"
#include "ops/cpu_isa.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

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
