// cpp/ops/argmax.h -- the index of the largest entry along the last axis, and accuracy's count of
// rows whose argmax equals the label. x (N, M) or (M,), out (N,) or () int64; logits (N, M), labels
// (N,) int32 or int64, count () float32. The first maximum wins ties and, like NumPy, a NaN counts
// as the maximum (the first NaN wins). No backward: the result is an index.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "cuda/stream.h"

namespace mgpu::ops {

Tensor argmax(const Tensor& x);
// How many rows of logits have their argmax equal to the label, as a 0-d float32 tensor.
Tensor correct_count(const Tensor& logits, const Tensor& labels);

namespace cpu {
// Writes out[i] = the column of row i's maximum of x (n, m). Precondition: m >= 1.
void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out);
}  // namespace cpu

namespace cuda {
// As cpu::argmax_rows, one warp per row.
void argmax_rows(int64_t n, int64_t m, const float* x, int64_t* out, cudaStream_t stream);
// *out = the number of rows i whose argmax equals labels[i], as a float; n == 0 gives 0. A label
// outside [0, m) never matches (compared as int64, never used as an index). One block: a warp per
// row, each warp counting its hits, then the warps' counts added in warp order (integers: exact
// and reproducible). Precondition: m >= 1 when n > 0.
void correct_count(int64_t n, int64_t m, const float* logits, const int64_t* labels, float* out,
                   cudaStream_t stream);
void correct_count(int64_t n, int64_t m, const float* logits, const int32_t* labels, float* out,
                   cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
