// cpp/ops/elementwise.h -- arithmetic on float32 tensors: a op b with equal shapes, with one
// operand broadcast over the other's rows (b's shape is a's trailing shape, as a bias is), or
// with a scalar; in-place forms for `t[:] += u`; fills, copies between devices, sums.
// The backward of a broadcast is sum_to_shape (summing dy over the broadcast leading axes).
// Kernels: the bodies below (for_each_index), elementwise_cpu.cpp, elementwise.cu.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mgpu::ops {

enum class BinaryOp : int8_t { Add, Sub, Mul, Div };

template <BinaryOp op>
MGPU_HD inline float apply(float a, float b) {
  if constexpr (op == BinaryOp::Add) return a + b;
  if constexpr (op == BinaryOp::Sub) return a - b;
  if constexpr (op == BinaryOp::Mul) return a * b;
  return a / b;
}

// out[i] = a[i % na] op b[i % nb]: na, nb are n or the length of a broadcast row.
template <BinaryOp op>
struct BinaryOut {
  const float* a; const float* b; float* out; int64_t na, nb;
  MGPU_HD void operator()(int64_t i) const { out[i] = apply<op>(a[i % na], b[i % nb]); }
};
template <BinaryOp op>
struct BinarySameOut {
  const float* a; const float* b; float* out;
  MGPU_HD void operator()(int64_t i) const { out[i] = apply<op>(a[i], b[i]); }
};
// out[i] = a[i] op s, or s op a[i] when scalar_first.
template <BinaryOp op>
struct BinaryScalarOut {
  const float* a; float s; float* out; bool scalar_first;
  MGPU_HD void operator()(int64_t i) const {
    out[i] = scalar_first ? apply<op>(s, a[i]) : apply<op>(a[i], s);
  }
};
struct FillOut {
  float* out; float value;
  MGPU_HD void operator()(int64_t i) const { out[i] = value; }
};
// The SGD rule, written once: every SGD update runs this body -- the book's optim.SGD, the
// chapter's sgd (p -= lr / N * g), the fused step's SGD and LeNet's step, the shared update of
// CPU replicas -- through cpu::sgd_step on a CPU device (one vectorised loop per combination of
// parts, per instruction-set path) and for_each_index on a GPU.
// PyTorch's SGD from the gradient of a loss summed over `batch` examples: g = grad / batch
// (times *clip when clip is non-null: clip_grad_norm_'s factor), plus weight_decay * param; with
// a momentum buffer (buf non-null) buf = momentum * buf + (1 - dampening) g, or buf = g at the
// first step (first; a zeroed buffer without dampening gives the same), then g = buf, or
// g + momentum * buf with nesterov; param -= lr * g. The chapter's rule is batch 1 (grad / 1 is
// grad exactly) with lr = lr / N. Each multiply-add is an explicit fmaf and every other product
// feeds a call, so the scalar loop, the AVX2 and AVX-512 kernels and the CUDA grid compute the
// same operations. grad is only read.
struct SgdParts {
  bool clip, decay, buf, first, damp, nesterov;
};
struct SgdStep {
  float* param; const float* grad; float* buf; float batch, lr, momentum, weight_decay;
  const float* clip = nullptr;
  float dampening = 0.0f;
  bool nesterov = false, first = false;
  // Element i with the optional parts `has` names: parts() here, constants in the CPU kernels.
  template <class Parts>
  MGPU_HD void update(int64_t i, Parts has) const {
    float g = grad[i] / batch;
    if (has.clip) g = g * *clip;
    if (has.decay) g = fmaf(param[i], weight_decay, g);
    if (has.buf) {
      float b = g;
      if (!has.first) b = fmaf(buf[i], momentum, has.damp ? (1.0f - dampening) * g : g);
      buf[i] = b;
      g = has.nesterov ? fmaf(momentum, b, g) : b;
    }
    param[i] = fmaf(-lr, g, param[i]);
  }
  MGPU_HD SgdParts parts() const {
    return SgdParts{clip != nullptr, weight_decay != 0.0f, buf != nullptr, first,
                    dampening != 0.0f, nesterov};
  }
  MGPU_HD void operator()(int64_t i) const { update(i, parts()); }
};

// PyTorch's Adam / AdamW at step t (t >= 1), from g = grad / batch (times *clip when clip is
// non-null). Adam adds weight_decay * param to g (L2 in the gradient); AdamW multiplies param by
// decay = 1 - lr * weight_decay first (decoupled weight decay). Then
//   m = m + (1 - beta1) (g - m)      v = beta2 v + (1 - beta2) g g
//   amsgrad (vmax non-null): vmax = max(vmax, v), and vmax stands for v in the next line
//   param -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), the bias corrections
// formed on the host in double as PyTorch forms them. Zeroed m, v (and vmax) give PyTorch's first
// step. Each multiply-add is an explicit fmaf, and every other product also feeds a product or a
// call, which no compiler fuses into an add: the scalar loop, the AVX2 and AVX-512 kernels
// (cpu::adam_step) and the CUDA grid compute the same operations.
struct AdamParts {
  bool clip, decay, l2, amsgrad;
};
struct AdamStep {
  float* param; const float* grad; float* m; float* v; const float* clip;
  float batch, one_minus_beta1, beta2, one_minus_beta2, eps, l2, decay, step_size, bc2_sqrt;
  float* vmax = nullptr;
  // Element i with the optional parts `has` names: parts() here, constants in the CPU kernels
  // (where each combination is a loop of its own, which the compiler vectorises).
  template <class Parts>
  MGPU_HD void update(int64_t i, Parts has) const {
    float g = grad[i] / batch;
    if (has.clip) g = g * *clip;
    float p = param[i];
    if (has.decay) p = p * decay;
    if (has.l2) g = fmaf(p, l2, g);
    const float mi = fmaf(one_minus_beta1, g - m[i], m[i]);
    const float vi = fmaf(v[i], beta2, one_minus_beta2 * g * g);
    m[i] = mi;
    v[i] = vi;
    float vd = vi;
    if (has.amsgrad) {
      const float old = vmax[i];
      vd = old > vi ? old : vi;  // a NaN v stays NaN, as torch.maximum keeps it
      vmax[i] = vd;
    }
    param[i] = fmaf(-step_size, mi / (sqrtf(vd) / bc2_sqrt + eps), p);
  }
  MGPU_HD AdamParts parts() const {
    return AdamParts{clip != nullptr, decay != 1.0f, l2 != 0.0f, vmax != nullptr};
  }
  MGPU_HD void operator()(int64_t i) const { update(i, parts()); }
};

// clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)) with norm = sqrt(sum_squares) *
// grad_scale (the gradient of the summed loss scaled to the mean's), the add fused explicitly.
MGPU_HD inline float clip_coefficient(float sum_squares, float grad_scale, float max_norm) {
  const float f = max_norm / fmaf(sqrtf(sum_squares), grad_scale, 1e-6f);
  return f < 1.0f ? f : 1.0f;
}
// clip_coefficient of *sum_squares into *factor. One element.
struct ClipFactor {
  const float* sum_squares; float* factor; float grad_scale, max_norm;
  MGPU_HD void operator()(int64_t) const {
    *factor = clip_coefficient(*sum_squares, grad_scale, max_norm);
  }
};

// Adam's hyperparameters at one step (see AdamStep); decoupled: AdamW.
struct AdamHyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  bool decoupled = false;
  int64_t step = 1;  // t, counted from 1
};
// The AdamStep of hyperparameters h for gradients of a sum over `batch` examples: its scalars
// set, its pointers null. lr, betas, eps and weight_decay come checked (Python checks them where
// the user gives them); raises ValueError (naming `op`) for a step count below 1 or batch <= 0.
AdamStep adam_body(const char* op, const AdamHyper& h, float batch);

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
Tensor binary_scalar(BinaryOp op, const Tensor& a, float s, bool scalar_first);
// a op= b in place (b equal-shaped or broadcast over a's rows).
void binary_inplace(BinaryOp op, const Tensor& a, const Tensor& b);
void binary_scalar_inplace(BinaryOp op, const Tensor& a, float s);
// dy summed over its leading axes down to `shape` (a trailing part of dy's shape).
Tensor sum_to_shape(const Tensor& dy, const Shape& shape);
// The sum of all elements, as a 0-d tensor (accumulated in double, in index order).
Tensor sum(const Tensor& x);
void fill(const Tensor& t, double value);
// dst[...] = src[...]: same number of elements and dtype, any two devices.
void copy(const Tensor& dst, const Tensor& src);
// A copy of src on `device` (src itself if it is already there and copy is false).
Tensor to_device(const Tensor& src, Device device, bool force_copy = false);
// Elementwise dtype conversion between any two of float32, bfloat16, int32, int64, uint8 (to
// bfloat16: dtype.h's rounding, from float32, or through float32 for the integer types).
Tensor astype(const Tensor& x, DType dtype);
// SGD's hyperparameters at one step (see SgdStep).
struct SgdHyper {
  float lr = 0.1f, momentum = 0.0f, dampening = 0.0f, weight_decay = 0.0f;
  bool nesterov = false, first = false;
};
// The SgdStep of hyperparameters h for gradients of a sum over `batch` examples: its scalars set,
// its pointers null.
SgdStep sgd_body(const SgdHyper& h, float batch);
// SgdStep on param, grad and momentum_buf (all one shape on one device; momentum_buf undefined:
// no momentum) from grad / batch times clip (a 0-d float32 tensor on that device, or undefined:
// 1). Writes param and momentum_buf in place, allocates nothing.
void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, float batch,
              const SgdHyper& h, const Tensor& clip = Tensor());
// AdamStep on param, grad and the moments m, v (all one shape on one device), from grad / batch
// times clip (a 0-d float32 tensor on that device, or undefined: 1); with vmax defined (that
// shape too) amsgrad. Writes param, m, v (and vmax) in place, allocates nothing. Raises
// ValueError for hyperparameters PyTorch refuses.
void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               float batch, const AdamHyper& h, const Tensor& clip = Tensor(),
               const Tensor& vmax = Tensor());
// The sum of x * x over every element, float products added in double, as a 0-d float32 tensor:
// on a CPU device in cpu::sum_squares_blocks' order (the same bits for any thread count), on a
// GPU as ops::sum adds.
Tensor sum_squares(const Tensor& x);
// clip_grad_norm_'s factor for a flat gradient: a 0-d tensor on grad's device holding
// min(1, max_norm / (||grad|| * grad_scale + 1e-6)), ||grad||^2 from sum_squares; max_norm
// comes checked (finite, >= 0).
Tensor clip_factor(const Tensor& grad, float grad_scale, float max_norm);

namespace cpu {
// sum_to_shape's row sums: db[j] = sum_i dy[i, j] over dy (n, m), added in i order (the
// documented order of the batch sum).
void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db);
// out[i] = a[i] + b[i] for i in [0, n) (BinarySameOut<Add>); out may be a or b.
void add_elements(int64_t n, const float* a, const float* b, float* out);
// body(i) for i in [begin, end): one vectorised loop per combination of body.parts(), each
// element with the operations of SgdStep::update, so with the bits of the scalar body.
void sgd_step(int64_t begin, int64_t end, const SgdStep& body);
// body(i) for i in [begin, end): one vectorised loop per combination of body.parts(), each
// element with the operations of AdamStep::update, so with the bits of the scalar body.
void adam_step(int64_t begin, int64_t end, const AdamStep& body);
// The sum of x[i] * x[i] (float products) over i in [0, n), added in double in a fixed order: 16
// lanes, lane l taking the i = l (mod 16) in i order, then the lanes in a fixed tree. The same
// bits on every instruction-set path.
double sum_squares(int64_t n, const float* x);
// The sum of squares of a whole flat buffer on the calling thread's share of cores: blocks of
// kElementBlock elements (block b starts at b * kElementBlock), each block's sum_squares, and the
// block sums added in block order, in double. The bits depend on n and x alone: not on the
// threads, nor on which device sums which block (the shared update sums blocks the same way).
double sum_squares_blocks(int64_t n, const float* x);
}  // namespace cpu

namespace cuda {
// As cpu::bias_grad_rows: a block of 32 columns x 8 row slices, slices added in order.
void bias_grad_rows(int64_t n, int64_t m, const float* dy, float* db, cudaStream_t stream);
// *out = sum of x[0, n) (n == 0 gives 0), as ops::sum: accumulated in double, rounded to float
// once. One block of 256 threads: thread t adds x[t], x[t + 256], ... in order, then a
// shared-memory tree of fixed shape adds the 256 partial sums, so the result is bitwise
// reproducible (though not bitwise equal to the CPU's index order).
void sum_all(int64_t n, const float* x, float* out, cudaStream_t stream);
// y[i] = static_cast<To>(x[i]) for i in [0, n) (ops::astype), To and From each one of float,
// int32_t, int64_t, uint8_t, BFloat16 (all 25 pairs are instantiated). Integer to integer wraps
// as on the CPU; float to an integer type truncates toward zero, and a value outside the target's
// range (or NaN) is undefined behaviour in C++ and differs between CPU (x86) and GPU (saturating).
template <class To, class From>
void convert(int64_t n, const From* x, To* y, cudaStream_t stream);
}  // namespace cuda

}  // namespace mgpu::ops
