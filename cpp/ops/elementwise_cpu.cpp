// cpp/ops/elementwise_cpu.cpp -- elementwise CPU kernels compiled per instruction-set path:
// sum_to_shape's row sums of dy (n, m) into db (m), the same-shape add (ResNet's residual
// connections, gradient accumulation), the SGD and Adam steps (one loop per combination of their
// optional parts), and one block's sum of squares (the gradient norm of clipping). Compiled with
// -fno-math-errno (CMakeLists.txt), so the square roots of the Adam step vectorise.
#include <algorithm>
#include <array>
#include <utility>

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

namespace {

// The optional parts of the SGD and Adam steps as constants, bit f of F set for each part present.
template <int F>
struct FixedSgdParts {
  static constexpr bool clip = F & 1, decay = F & 2, buf = F & 4, first = F & 8, damp = F & 16,
                        nesterov = F & 32;
};
template <int F>
struct FixedAdamParts {
  static constexpr bool clip = F & 1, decay = F & 2, l2 = F & 4, amsgrad = F & 8;
};

// An optimizer's body over [begin, end) with its parts fixed, so the loop vectorises.
template <class Body, class Parts>
void parts_loop(int64_t begin, int64_t end, const Body& body) {
  // The clip factor read once into a local: the loop's stores cannot alias it, so it vectorises.
  Body s = body;
  float clip = 1.0f;
  if (Parts::clip) {
    clip = *body.clip;
    s.clip = &clip;
  }
  for (int64_t i = begin; i < end; ++i) s.update(i, Parts{});
}

// The loop of every combination of parts, indexed by F.
template <class Body, template <int> class Parts, int... F>
constexpr std::array<void (*)(int64_t, int64_t, const Body&), sizeof...(F)> parts_loops(
    std::integer_sequence<int, F...>) {
  return {&parts_loop<Body, Parts<F>>...};
}

}  // namespace

void sgd_step(int64_t begin, int64_t end, const SgdStep& body) {
  static constexpr auto loops =
      parts_loops<SgdStep, FixedSgdParts>(std::make_integer_sequence<int, 64>{});
  const SgdParts has = body.parts();
  // Without a buffer first, dampening and nesterov mean nothing: those loops are never taken.
  const int f = (has.clip ? 1 : 0) | (has.decay ? 2 : 0) |
                (has.buf ? 4 | (has.first ? 8 : 0) | (has.damp ? 16 : 0) |
                               (has.nesterov ? 32 : 0)
                         : 0);
  loops[static_cast<size_t>(f)](begin, end, body);
}

void adam_step(int64_t begin, int64_t end, const AdamStep& body) {
  static constexpr auto loops =
      parts_loops<AdamStep, FixedAdamParts>(std::make_integer_sequence<int, 16>{});
  const AdamParts has = body.parts();
  const int f = (has.clip ? 1 : 0) | (has.decay ? 2 : 0) | (has.l2 ? 4 : 0) | (has.amsgrad ? 8 : 0);
  loops[static_cast<size_t>(f)](begin, end, body);
}

double sum_squares(int64_t n, const float* x) {
  // Lane l adds the squares of x[l], x[l + 16], ... in order (a float product, then a double
  // add: nothing to contract into an FMA), so each ISA's vectors hold the same 16 partial sums.
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float sq = x[i + l] * x[i + l];
      acc[l] += static_cast<double>(sq);
    }
  }
  for (int l = 0; i + l < n; ++l) {
    const float sq = x[i + l] * x[i + l];
    acc[l] += static_cast<double>(sq);
  }
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) acc[l] += acc[l + half];
  return acc[0];
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
