// cpp/ops/batch_norm.h -- batch normalisation (d2l 12.6's ResNet-18): per-channel statistics over
// N, H, W. x, y, dy, dx (N, C, H, W) or (N, C) (seen as H = W = 1), float32 contiguous; mean, var,
// gamma, beta, sum_dy, sum_dy_xhat (C,). count = N*H*W elements per channel. Forward keeps nothing;
// backward re-reads x and the statistics. Kernels: batch_norm_cpu.cpp, batch_norm.cu.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "cuda/stream.h"
#include "ops/dispatch.h"

namespace mgpu::ops {

// (mean, var) per channel; var is the biased variance (divided by count). Summed in double, in the
// fixed order the kernels below document: bitwise independent of the thread count.
std::pair<Tensor, Tensor> batch_norm_stats(const Tensor& x);

// y = (x - mean) / sqrt(var + eps) * gamma + beta; gamma and beta may be null (affine=False).
Tensor batch_norm_forward(const Tensor& x, const Tensor& mean, const Tensor& var,
                          const Tensor* gamma, const Tensor* beta, float eps);

// (sum_dy, sum_dy_xhat) per channel with xhat = (x - mean) / sqrt(var + eps): dbeta and dgamma.
std::pair<Tensor, Tensor> batch_norm_backward_reduce(const Tensor& x, const Tensor& dy,
                                                     const Tensor& mean, const Tensor& var,
                                                     float eps);

// dx. training: gamma * invstd * (dy - sum_dy / count - xhat * sum_dy_xhat / count), the
// statistics being functions of x; evaluation: gamma * invstd * dy (running statistics are
// constants). gamma null means 1. count is the elements per channel the statistics were taken over
// (summed over devices for synchronised batch norm, then the sums are the all-reduced ones).
Tensor batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& mean,
                           const Tensor& var, const Tensor* gamma, const Tensor& sum_dy,
                           const Tensor& sum_dy_xhat, double count, float eps, bool training);

// ---- batch norm + ReLU (+ residual add), one pass each way (the fused step's BatchNormRelu and
// BatchNormAddRelu layers) ----
// y = relu(bn(x) + shortcut), shortcut null for y = relu(bn(x)); relu as relu.h has it (NaN
// passes). The BN output and the pre-ReLU sum never exist as tensors. The arithmetic is that of
// batch_norm_forward, then the add, then relu, in that order: the same bits as the three ops.
// CPU devices only (one kernel; a GPU raises ValueError: the fused step's Model runs
// batch_norm_forward, the add and relu one by one there). So are the two ops below.
Tensor batch_norm_act_forward(const Tensor& x, const Tensor& mean, const Tensor& var,
                              const Tensor* gamma, const Tensor* beta, const Tensor* shortcut,
                              float eps);
// (sum_dz, sum_dz_xhat) per channel, dz = dy where y > 0 (the mask from the saved output y, as
// relu_backward takes it), else 0: dbeta and dgamma. The same sums (and bits) as
// batch_norm_backward_reduce(x, relu_backward(y, dy)).
std::pair<Tensor, Tensor> batch_norm_act_backward_reduce(const Tensor& x, const Tensor& y,
                                                         const Tensor& dy, const Tensor& mean,
                                                         const Tensor& var, float eps);
// (dx, dshortcut) in training mode: dx as batch_norm_backward(x, dz, ...) with dz as above, and
// dshortcut = dz when want_dshortcut (the add hands its gradient to both operands), else
// undefined. sum_dz and sum_dz_xhat are the sums above (all replicas' for synchronised BN).
std::pair<Tensor, Tensor> batch_norm_act_backward(const Tensor& x, const Tensor& y,
                                                  const Tensor& dy, const Tensor& mean,
                                                  const Tensor& var, const Tensor* gamma,
                                                  const Tensor& sum_dz, const Tensor& sum_dz_xhat,
                                                  double count, float eps, bool want_dshortcut);

// ---- the whole training backward with this replica's own statistics (no synchronisation) ----
// (sum_dy, sum_dy_xhat, dx, dshortcut) of batch_norm_backward_reduce + batch_norm_backward
// (training, y null) or of batch_norm_act_backward_reduce + batch_norm_act_backward (y the saved
// relu output), with count = N*H*W, in one op and with the same bits. On CPU devices one kernel
// that handles a group of channels at a time (their sums, then their dx), so dx re-reads x, y, dy
// from cache instead of memory; on GPUs the two ops, without y (the fused relu is CPU only). dx
// is undefined unless want_dx; dshortcut (= dz) unless want_dshortcut (which needs y).
struct BatchNormGrads {
  Tensor sum_dy, sum_dy_xhat, dx, dshortcut;
};
BatchNormGrads batch_norm_backward_full(const Tensor& x, const Tensor* y, const Tensor& dy,
                                        const Tensor& mean, const Tensor& var,
                                        const Tensor* gamma, float eps, bool want_dx,
                                        bool want_dshortcut);

// ---- synchronised batch norm: K replicas' parts combined into the statistics of their union ----
// Every replica holds the same rows (an all-reduce of zero-padded rows, each replica writing only
// its own: an all-gather whose sums are exact) and combines them in row order 0..K-1 in double,
// so every replica ends with the same bits, whatever the device count.

// parts (K, 1 + 2C): row k = (count_k, mean_k (C), var_k (C)), biased variance; count 0 marks a
// replica without examples. mean = sum n_k m_k / n, var = sum n_k (v_k + (m_k - mean)^2) / n
// (Chan et al.'s parallel formula: no cancellation when the mean is far from zero).
struct BatchNormCombineStats {
  const float* parts; int64_t K, C; float* mean; float* var;
  MGPU_HD void operator()(int64_t c) const {
    const int64_t row = 1 + 2 * C;
    double n = 0.0, s = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double nk = parts[k * row];
      n += nk;
      s += nk * static_cast<double>(parts[k * row + 1 + c]);
    }
    const double m = s / n;
    double v = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double nk = parts[k * row];
      const double d = static_cast<double>(parts[k * row + 1 + c]) - m;
      v += nk * (static_cast<double>(parts[k * row + 1 + C + c]) + d * d);
    }
    mean[c] = static_cast<float>(m);
    var[c] = static_cast<float>(v / n);
  }
};
// parts (K, 2C): row k = (sum_dy_k (C), sum_dy_xhat_k (C)); out (2C,) = the row sums.
struct BatchNormCombineSums {
  const float* parts; int64_t K, C; float* out;
  MGPU_HD void operator()(int64_t j) const {
    double s = 0.0;
    for (int64_t k = 0; k < K; ++k) s += static_cast<double>(parts[k * 2 * C + j]);
    out[j] = static_cast<float>(s);
  }
};

// ---- running statistics ----
// running = running * keep + batch * step in place (three elementwise ops, on running's device):
// PyTorch's update with keep = 1 - momentum and step = momentum for the mean, momentum times the
// unbiasing factor n / (n - 1) for the variance. The factors are the callers' (the fused step's
// layers, ops.batch_norm, nn.SyncBatchNorm), each rounded as that caller computes it.
void batch_norm_update_running(const Tensor& running, const Tensor& batch, float keep, float step);

// (mean, var) (C,) each of the union from parts (K, 1 + 2C) as above; the total count must be > 0.
std::pair<Tensor, Tensor> batch_norm_combine_stats(const Tensor& parts);
// The same from K replicas' own statistics on any devices: row k of the parts, made on `at`, is
// (counts[k], means[k], vars[k]) (each (C,)); a replica with count 0 gives a zero row. The book's
// nn.SyncBatchNorm combines with this, the fused step's synchronised layer with the rows it
// gathered: one combine, the same bits.
std::pair<Tensor, Tensor> batch_norm_combine_stats(const std::vector<Tensor>& means,
                                                   const std::vector<Tensor>& vars,
                                                   const std::vector<double>& counts, Device at);
// (sum_dy, sum_dy_xhat) (C,) each from parts (K, 2C): the sums over every replica.
std::pair<Tensor, Tensor> batch_norm_combine_sums(const Tensor& parts);
// The same from K replicas' own sums on any devices: row k of the parts, made on `at`, is
// (sum_dys[k], sum_dy_xhats[k]) (each (C,)). The book's nn.SyncBatchNorm combines its backward's
// sums with this, the fused step's synchronised layer the rows it gathered: one combine (in
// double, rows in order 0..K-1), the same bits.
std::pair<Tensor, Tensor> batch_norm_combine_sums(const std::vector<Tensor>& sum_dys,
                                                  const std::vector<Tensor>& sum_dy_xhats,
                                                  Device at);

// ---- raw kernels: x, dy, y, dx (N, C, HW) contiguous; per-channel arrays (C,) ----
// Every kernel overwrites its outputs. Per-channel sums accumulate x - shift (shift = the
// channel's first element, so mean >> std loses nothing) in double.
namespace cpu {
// Tasks take groups of neighbouring channels; within a channel, element i of each row (n, c, :)
// goes into double lane i % 16 of the row's sums, each row's lanes are added into the channel's
// in n order, and the channel's lanes are added 0..15.
void batch_norm_stats(int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var);
// gamma, beta may be null.
void batch_norm_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                        const float* var, const float* gamma, const float* beta, float eps,
                        float* y);
// Same order of summation as batch_norm_stats.
void batch_norm_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                                const float* mean, const float* var, float eps, float* sum_dy,
                                float* sum_dy_xhat);
// gamma may be null; sum_dy and sum_dy_xhat are read only when training.
void batch_norm_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                         const float* mean, const float* var, const float* gamma,
                         const float* sum_dy, const float* sum_dy_xhat, double count, float eps,
                         bool training, float* dx);
// The fused kernels above: shortcut, gamma, beta, dshortcut may be null. Forward and dx in
// blocks of rows as batch_norm_forward; the reduce in batch_norm_backward_reduce's order.
void batch_norm_act_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                            const float* var, const float* gamma, const float* beta,
                            const float* shortcut, float eps, float* y);
void batch_norm_act_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x,
                                    const float* y, const float* dy, const float* mean,
                                    const float* var, float eps, float* sum_dz,
                                    float* sum_dz_xhat);
void batch_norm_act_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* y,
                             const float* dy, const float* mean, const float* var,
                             const float* gamma, const float* sum_dz, const float* sum_dz_xhat,
                             double count, float eps, float* dx, float* dshortcut);
// batch_norm_backward_full: y, gamma, dx, dshortcut may be null (dx null: the sums only). Tasks
// take groups of neighbouring channels and do their sums (batch_norm_backward_reduce's order)
// and then their dx rows.
void batch_norm_backward_full(int64_t N, int64_t C, int64_t HW, const float* x, const float* y,
                              const float* dy, const float* mean, const float* var,
                              const float* gamma, float eps, float* sum_dy, float* sum_dy_xhat,
                              float* dx, float* dshortcut);
}  // namespace cpu

namespace cuda {
// The reductions run in two launches without atomics: each channel's N*HW elements (in (n, hw)
// order) are cut into batch_norm_chunks(N, HW) contiguous chunks, one block each, whose threads
// add their elements in order and then a shared-memory tree of fixed shape adds the threads; a
// second kernel adds the chunks' partial sums per channel by another fixed tree. The chunking
// depends only on the shape, so results are bitwise reproducible (not bitwise equal to cpu::).
int64_t batch_norm_chunks(int64_t N, int64_t HW);
// Device scratch the two reductions need: 2 doubles per (channel, chunk).
size_t batch_norm_workspace_bytes(int64_t N, int64_t C, int64_t HW);
void batch_norm_stats(int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var,
                      void* workspace, cudaStream_t stream);
void batch_norm_forward(int64_t N, int64_t C, int64_t HW, const float* x, const float* mean,
                        const float* var, const float* gamma, const float* beta, float eps,
                        float* y, cudaStream_t stream);
void batch_norm_backward_reduce(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                                const float* mean, const float* var, float eps, float* sum_dy,
                                float* sum_dy_xhat, void* workspace, cudaStream_t stream);
void batch_norm_backward(int64_t N, int64_t C, int64_t HW, const float* x, const float* dy,
                         const float* mean, const float* var, const float* gamma,
                         const float* sum_dy, const float* sum_dy_xhat, double count, float eps,
                         bool training, float* dx, cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
