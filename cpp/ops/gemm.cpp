// cpp/ops/gemm.cpp -- sgemm over CBLAS, and keeping OpenBLAS single-threaded under mgpu's own
// threads. Shapes as in gemm.h: op(A) (m, k), op(B) (k, n), C (m, n), all row-major. The BLAS is
// PyPI's scipy-openblas32 (MGPU_BLAS_PYPI: its symbols carry a scipy_ prefix) or the system's.
#include "ops/gemm.h"

#include <cblas.h>

#include <climits>
#include <stdexcept>
#include <string>

#if MGPU_BLAS_PYPI
#define MGPU_CBLAS_SGEMM scipy_cblas_sgemm
#else
#define MGPU_CBLAS_SGEMM cblas_sgemm
// Declared weak (and redeclared here, since only OpenBLAS's cblas.h declares them) so mgpu still
// links against a system BLAS without these symbols; the pointers are then null and unused.
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));
extern "C" char* openblas_get_config() __attribute__((weak));
#endif

namespace mgpu::ops::cpu {

namespace {

int blas_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) {
    throw std::length_error(std::string("sgemm: ") + what + " = " + std::to_string(v) +
                            " does not fit the BLAS integer type (0 .. " + std::to_string(INT_MAX) +
                            ")");
  }
  return static_cast<int>(v);
}

}  // namespace

void blas_init_single_threaded() {
  // A function-local static runs the call once, thread-safely, however many threads get here.
  static const bool done = [] {
#if MGPU_BLAS_PYPI
    scipy_openblas_set_num_threads(1);
#else
    if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
#endif
    return true;
  }();
  (void)done;
}

std::string blas_info() {
  std::string info = MGPU_BLAS_PYPI ? "OpenBLAS from PyPI (scipy-openblas32)"
                                    : "the system's BLAS (MGPU_BLAS=system)";
#if MGPU_BLAS_PYPI
  const char* config = scipy_openblas_get_config();
#else
  const char* config = openblas_get_config != nullptr ? openblas_get_config() : nullptr;
#endif
  if (config != nullptr) info += std::string(": ") + config;
  return info + "; single-threaded calls, mgpu schedules the cores";
}

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  // A BLAS reports bad arguments through xerbla, which prints; library code must throw instead.
  const int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < a_cols || ldb < b_cols || ldc < n) {
    throw std::invalid_argument(
        "sgemm: row strides lda=" + std::to_string(lda) + ", ldb=" + std::to_string(ldb) +
        ", ldc=" + std::to_string(ldc) + " are smaller than the rows they step over (" +
        std::to_string(a_cols) + ", " + std::to_string(b_cols) + ", " + std::to_string(n) + ")");
  }
  if (k <= 0) {
    // Empty product: C = beta * C, and BLAS's rule that beta == 0 never reads C.
    for (int64_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  blas_init_single_threaded();
  MGPU_CBLAS_SGEMM(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blas_int(m, "m"), blas_int(n, "n"),
              blas_int(k, "k"), alpha, a, blas_int(lda, "lda"), b, blas_int(ldb, "ldb"), beta, c,
              blas_int(ldc, "ldc"));
}

}  // namespace mgpu::ops::cpu
