// cpp/ops/softmax_ce_cpu.cpp -- softmax cross-entropy (one op, reduction none) on the CPU.
// logits, dlogits (n, m); labels (n) int64 or int32 class indices; loss, dloss (n).
// loss_i = logsumexp(z_i) - z_i[y_i]; backward dlogits_i = (softmax(z_i) - onehot(y_i)) * dloss_i.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/parallel.h"
#include "ops/cpu_isa.h"
#include "ops/softmax_ce.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace {

// Rows per parallel task (LeNet: m = 10 classes, so a row is a few dozen flops).
constexpr int64_t kRowsPerTask = 64;

// Labels come from user data and index the logits, so they are checked before any row is read
// or any output written; a bad one names itself, its row and the number of classes.
template <class Label>
void check_labels(const char* op, int64_t n, int64_t m, const Label* labels) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = static_cast<int64_t>(labels[i]);
    if (label < 0 || label >= m) {
      throw std::out_of_range(std::string(op) + ": label " + std::to_string(label) + " in row " +
                              std::to_string(i) + " is out of range for " + std::to_string(m) +
                              " classes; labels must be class indices in [0, " + std::to_string(m) +
                              ")");
    }
  }
}

// Softmax terms of one row relative to its maximum: z[top] is the (first) maximum, and
// rest = sum over j != top of exp(z[j] - z[top]), each term in (0, 1], added in j order. So
// sum_j exp(z[j] - max) = 1 + rest never overflows, and log1p(rest) keeps small losses exact.
struct RowStats {
  int64_t top;
  float rest;
};
RowStats row_stats(const float* z, int64_t m) {
  int64_t top = 0;
  for (int64_t j = 1; j < m; ++j) {
    if (z[j] > z[top]) top = j;
  }
  float rest = 0.0f;
  for (int64_t j = 0; j < m; ++j) {
    if (j != top) rest += std::exp(z[j] - z[top]);
  }
  return {top, rest};
}

template <class F>
void for_row_blocks(int64_t n, F&& fn) {
  parallel_for((n + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t first = task * kRowsPerTask;
    fn(first, std::min(n, first + kRowsPerTask));
  });
}

template <class Label>
void forward(int64_t n, int64_t m, const float* logits, const Label* labels, float* loss) {
  check_labels("softmax_ce_forward", n, m, labels);
  for_row_blocks(n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const float* z = logits + i * m;
      const RowStats st = row_stats(z, m);
      loss[i] = (z[st.top] - z[static_cast<int64_t>(labels[i])]) + std::log1p(st.rest);
    }
  });
}

template <class Label>
void backward(int64_t n, int64_t m, const float* logits, const Label* labels, const float* dloss,
              float* dlogits) {
  check_labels("softmax_ce_backward", n, m, labels);
  for_row_blocks(n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const float* z = logits + i * m;
      float* dz = dlogits + i * m;
      const RowStats st = row_stats(z, m);
      const float inv_sum = 1.0f / (1.0f + st.rest);
      const int64_t label = static_cast<int64_t>(labels[i]);
      for (int64_t j = 0; j < m; ++j) {
        const float p = std::exp(z[j] - z[st.top]) * inv_sum;
        dz[j] = (p - (j == label ? 1.0f : 0.0f)) * dloss[i];
      }
    }
  });
}

}  // namespace

void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                        float* loss) {
  forward(n, m, logits, labels, loss);
}
void softmax_ce_forward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                        float* loss) {
  forward(n, m, logits, labels, loss);
}
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int64_t* labels,
                         const float* dloss, float* dlogits) {
  backward(n, m, logits, labels, dloss, dlogits);
}
void softmax_ce_backward(int64_t n, int64_t m, const float* logits, const int32_t* labels,
                         const float* dloss, float* dlogits) {
  backward(n, m, logits, labels, dloss, dlogits);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
