// cpp/ops/elementwise.cpp -- checks, allocation and dispatch for elementwise.h.
#include "ops/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace mgpu::ops {
namespace {

const char* op_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add: return "add";
    case BinaryOp::Sub: return "subtract";
    case BinaryOp::Mul: return "multiply";
    case BinaryOp::Div: return "divide";
  }
  return "?";
}

bool is_suffix(const Shape& small, const Shape& big) {
  if (small.size() > big.size()) return false;
  return std::equal(small.begin(), small.end(), big.end() - static_cast<int64_t>(small.size()));
}

void check_float_operands(BinaryOp op, const Tensor& a, const Tensor& b) {
  require_dtype(op_name(op), "the left operand", a, DType::F32);
  require_dtype(op_name(op), "the right operand", b, DType::F32);
  require_same_device(op_name(op), {&a, &b});
}

template <BinaryOp op>
void launch_binary(const Tensor& a, const Tensor& b, const Tensor& out) {
  int64_t n = out.numel();
  if constexpr (op == BinaryOp::Add) {
    if (a.numel() == n && b.numel() == n) {
      // The add on the CPU is a kernel of each instruction-set path (cpu_isa.h).
      if (n == 0) return;
      const float *pa = a.f32(), *pb = b.f32();
      float* po = out.f32();
      dispatch(out.device(), op_name(op), [=] { cpu::add_elements(n, pa, pb, po); },
               [=](cudaStream_t s) { cuda::for_each_index(n, BinarySameOut<op>{pa, pb, po}, s); },
               a, b, out);
      return;
    }
  }
  if (a.numel() == n && b.numel() == n)
    for_each_index(op_name(op), out.device(), n, BinarySameOut<op>{a.f32(), b.f32(), out.f32()},
                   a, b, out);
  else
    for_each_index(op_name(op), out.device(), n,
                   BinaryOut<op>{a.f32(), b.f32(), out.f32(), a.numel(), b.numel()}, a, b, out);
}

void dispatch_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  switch (op) {
    case BinaryOp::Add: return launch_binary<BinaryOp::Add>(a, b, out);
    case BinaryOp::Sub: return launch_binary<BinaryOp::Sub>(a, b, out);
    case BinaryOp::Mul: return launch_binary<BinaryOp::Mul>(a, b, out);
    case BinaryOp::Div: return launch_binary<BinaryOp::Div>(a, b, out);
  }
}

template <BinaryOp op>
void launch_scalar(const Tensor& a, float s, bool scalar_first, const Tensor& out) {
  for_each_index(op_name(op), out.device(), out.numel(),
                 BinaryScalarOut<op>{a.f32(), s, out.f32(), scalar_first}, a, out);
}

void dispatch_scalar(BinaryOp op, const Tensor& a, float s, bool first, const Tensor& out) {
  switch (op) {
    case BinaryOp::Add: return launch_scalar<BinaryOp::Add>(a, s, first, out);
    case BinaryOp::Sub: return launch_scalar<BinaryOp::Sub>(a, s, first, out);
    case BinaryOp::Mul: return launch_scalar<BinaryOp::Mul>(a, s, first, out);
    case BinaryOp::Div: return launch_scalar<BinaryOp::Div>(a, s, first, out);
  }
}

template <typename To, typename From>
void convert(const Tensor& x, const Tensor& out) {
  const From* src = x.data<From>();
  To* dst = out.data<To>();
  dispatch(out.device(), "astype",
           [src, dst, n = x.numel()] {
             for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<To>(src[i]);
           },
           [src, dst, n = x.numel()](cudaStream_t s) { cuda::convert<To, From>(n, src, dst, s); },
           x, out);
}

template <typename To>
void convert_from(const Tensor& x, const Tensor& out) {
  switch (x.dtype()) {
    case DType::F32: return convert<To, float>(x, out);
    case DType::I32: return convert<To, int32_t>(x, out);
    case DType::I64: return convert<To, int64_t>(x, out);
    case DType::U8: return convert<To, uint8_t>(x, out);
    case DType::BF16: return convert<To, BFloat16>(x, out);
  }
}

}  // namespace

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_float_operands(op, a, b);
  const Tensor* big = &a;
  if (a.shape() != b.shape()) {
    if (is_suffix(b.shape(), a.shape())) big = &a;
    else if (is_suffix(a.shape(), b.shape())) big = &b;
    else
      MGPU_CHECK_VALUE(false, op_name(op), ": shapes ", a.shape(), " and ", b.shape(),
                       " do not match; operands must have equal shapes, or one must be the "
                       "other's trailing shape (a bias broadcast over rows)");
  }
  Tensor out = Tensor::empty_like(*big);
  dispatch_binary(op, a, b, out);
  return out;
}

Tensor binary_scalar(BinaryOp op, const Tensor& a, float s, bool scalar_first) {
  require_dtype(op_name(op), "the tensor operand", a, DType::F32);
  Tensor out = Tensor::empty_like(a);
  dispatch_scalar(op, a, s, scalar_first, out);
  return out;
}

void binary_inplace(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_float_operands(op, a, b);
  MGPU_CHECK_VALUE(a.shape() == b.shape() || is_suffix(b.shape(), a.shape()), op_name(op),
                   " in place: the right operand's shape ", b.shape(),
                   " must equal the target's shape ", a.shape(), " or be its trailing shape");
  dispatch_binary(op, a, b, a);
}

void binary_scalar_inplace(BinaryOp op, const Tensor& a, float s) {
  require_dtype(op_name(op), "the tensor operand", a, DType::F32);
  dispatch_scalar(op, a, s, false, a);
}

Tensor sum_to_shape(const Tensor& dy, const Shape& shape) {
  require_dtype("sum_to_shape", "dy", dy, DType::F32);
  MGPU_CHECK_VALUE(is_suffix(shape, dy.shape()), "sum_to_shape: ", shape,
                   " is not a trailing shape of ", dy.shape());
  Tensor out = Tensor::empty(shape, DType::F32, dy.device());
  int64_t m = out.numel(), rows = m ? dy.numel() / m : 0;
  const float* src = dy.f32();
  float* dst = out.f32();
  // Rows added in a fixed order on both: the result does not depend on the thread count.
  dispatch(out.device(), "sum_to_shape", [=] { cpu::bias_grad_rows(rows, m, src, dst); },
           [=](cudaStream_t s) { cuda::bias_grad_rows(rows, m, src, dst, s); }, dy, out);
  return out;
}

Tensor sum(const Tensor& x) {
  require_dtype("sum", "x", x, DType::F32);
  Tensor out = Tensor::empty({}, DType::F32, x.device());
  const float* src = x.f32();
  float* dst = out.f32();
  dispatch(out.device(), "sum",
           [src, dst, n = x.numel()] {
             double acc = 0.0;
             for (int64_t i = 0; i < n; ++i) acc += src[i];
             *dst = static_cast<float>(acc);
           },
           [src, dst, n = x.numel()](cudaStream_t s) { cuda::sum_all(n, src, dst, s); }, x, out);
  return out;
}

void fill(const Tensor& t, double value) {
  switch (t.dtype()) {
    case DType::F32:
      for_each_index("fill", t.device(), t.numel(), FillOut{t.f32(), static_cast<float>(value)}, t);
      return;
    default: {
      Tensor f = Tensor::empty(t.shape(), DType::F32, t.device());
      fill(f, value);
      copy(t, astype(f, t.dtype()));
    }
  }
}

void copy(const Tensor& dst, const Tensor& src) {
  MGPU_CHECK_VALUE(dst.numel() == src.numel(), "copy: cannot copy ", src.numel(),
                   " elements (shape ", src.shape(), ") into ", dst.numel(), " (shape ",
                   dst.shape(), ")");
  MGPU_CHECK_TYPE(dst.dtype() == src.dtype(), "copy: dtypes differ (", dtype_name(src.dtype()),
                  " into ", dtype_name(dst.dtype()), ")");
  if (dst.nbytes() == 0 || (dst.storage() == src.storage() && dst.offset() == src.offset()))
    return;
  void* to = dst.raw();
  const void* from = src.raw();
  size_t n = dst.nbytes();
  const Device dd = dst.device(), sd = src.device();
  if (dd == sd) {
    dispatch(dd, "copy", [to, from, n] { std::memmove(to, from, n); },
             [to, from, n, i = dd.index](cudaStream_t) { gpu::copy_within(i, to, from, n); }, dst,
             src);
    return;
  }
  // Between two devices the copy runs on one queue -- the GPU's if one side is a GPU (its stream
  // does the transfer), else the destination's -- once the other device's earlier work is done
  // (for a GPU: finished on its stream). Then the other queue waits for the copy, so no later
  // write on either side can race with it. Both queues stay ordered; neither blocks the host.
  const Device exec = !dd.is_cpu() || sd.is_cpu() ? dd : sd;
  const Device other = exec == dd ? sd : dd;
  Event other_ready = record_event(other);
  Queue& eq = queue_of(exec);
  const detail::TaskOutputs outs = detail::claim_outputs(dst, src);
  uint64_t seq = eq.enqueue("copy", [to, from, n, dd, sd, other_ready, dst, src,
                                     outputs = outs.mask] {
    try {
      other_ready.queue->wait_done_or_rethrow(other_ready.seq);
      // After that wait a failed producer of src has left its error on src (sticky failures).
      if (std::exception_ptr e = detail::failed_input(outputs, dst, src)) std::rethrow_exception(e);
    } catch (...) {
      // Nothing waits for this copy but its own device's queue, so it may stop here.
      detail::fail_outputs(outputs, std::current_exception(), dst, src);
      throw;
    }
    if (dd.is_cpu() && sd.is_cpu()) {
      std::memcpy(to, from, n);
    } else if (sd.is_cpu()) {
      gpu::copy_from_host(dd.index, to, from, n);
    } else if (dd.is_cpu()) {
      gpu::copy_to_host(sd.index, to, from, n);
    } else {
      gpu::copy_from_peer(dd.index, to, sd.index, from, n);
    }
  }, outs.bytes);
  // The other queue waits for the copy, holding both tensors until then: the copy runs on the
  // exec device's stream, asynchronously to all work on the other device, so neither block may
  // return to the other device's cache (where its worker could reuse it at once, e.g. for a
  // cuDNN workspace) before the copy has finished.
  queue_of(other).enqueue("wait_event", [done = Event{&eq, seq}, dst, src] {
    done.queue->wait_done_or_rethrow(done.seq);
  });
}

Tensor to_device(const Tensor& src, Device device, bool force_copy) {
  if (src.device() == device && !force_copy) return src;
  Tensor out = Tensor::empty(src.shape(), src.dtype(), device);
  copy(out, src);
  return out;
}

Tensor astype(const Tensor& x, DType dtype) {
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  switch (dtype) {
    case DType::F32: convert_from<float>(x, out); break;
    case DType::I32: convert_from<int32_t>(x, out); break;
    case DType::I64: convert_from<int64_t>(x, out); break;
    case DType::U8: convert_from<uint8_t>(x, out); break;
    case DType::BF16: convert_from<BFloat16>(x, out); break;
  }
  return out;
}

namespace {

// clip: a 0-d float32 factor on param's device, or undefined (no clipping).
const float* clip_pointer(const char* op, const Tensor& param, const Tensor& clip) {
  if (!clip.defined()) return nullptr;
  require_dtype(op, "clip factor", clip, DType::F32);
  require_same_device(op, {&param, &clip});
  MGPU_CHECK_VALUE(clip.numel() == 1, op, ": the clip factor must hold one value, got shape ",
                   clip.shape());
  return clip.f32();
}

// An optimizer's body over [0, n) on a CPU device: the kernel of the instruction-set path
// (cpu_isa.h) on fixed blocks of kElementBlock elements, in parallel.
template <class Body>
void in_blocks(int64_t n, const Body& body, void (*kernel)(int64_t, int64_t, const Body&)) {
  const int64_t blocks = (n + kElementBlock - 1) / kElementBlock;
  if (blocks <= 1) {
    kernel(0, n, body);
    return;
  }
  parallel_for(blocks, [&](int64_t b) {
    kernel(b * kElementBlock, std::min(n, (b + 1) * kElementBlock), body);
  });
}

}  // namespace

SgdStep sgd_body(const SgdHyper& h, float batch) {
  return SgdStep{nullptr, nullptr, nullptr, batch, h.lr, h.momentum, h.weight_decay, nullptr,
                 h.dampening, h.nesterov, h.first};
}

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, float batch,
              const SgdHyper& h, const Tensor& clip) {
  require_dtype("sgd", "param", param, DType::F32);
  require_dtype("sgd", "grad", grad, DType::F32);
  require_same_device("sgd", {&param, &grad});
  MGPU_CHECK_VALUE(param.shape() == grad.shape(), "sgd: grad has shape ", grad.shape(),
                   " but the parameter has shape ", param.shape());
  float* buf = nullptr;
  if (momentum_buf.defined()) {
    require_dtype("sgd", "momentum buffer", momentum_buf, DType::F32);
    require_same_device("sgd", {&param, &momentum_buf});
    MGPU_CHECK_VALUE(momentum_buf.shape() == param.shape(), "sgd: the momentum buffer has shape ",
                     momentum_buf.shape(), " but the parameter has shape ", param.shape());
    buf = momentum_buf.f32();
  }
  SgdStep body = sgd_body(h, batch);
  body.param = param.f32();
  body.grad = grad.f32();
  body.buf = buf;
  body.clip = clip_pointer("sgd", param, clip);
  const int64_t n = param.numel();
  if (n == 0) return;
  dispatch(param.device(), "sgd", [n, body] { in_blocks(n, body, &cpu::sgd_step); },
           [n, body](cudaStream_t s) { cuda::for_each_index(n, body, s); }, param, grad,
           momentum_buf, clip);
}

AdamStep adam_body(const char* op, const AdamHyper& h, float batch) {
  // lr, betas, eps and weight_decay as Python checked them where the user gave them (the
  // optimizer's groups, FusedModel.train_step), as sgd_step takes its own. The step count
  // comes from the optimizer's state, which no setter checks, so it is checked here.
  MGPU_CHECK_VALUE(h.step >= 1, op, ": the step count starts at 1, got ", h.step);
  MGPU_CHECK_VALUE(batch > 0, op, ": the batch must be > 0, got ", batch);
  // As PyTorch: the bias corrections and the decay factor in double, rounded to float once.
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  const double lr = h.lr, wd = h.weight_decay;
  return AdamStep{nullptr, nullptr, nullptr, nullptr, nullptr, batch,
                  static_cast<float>(1.0 - static_cast<double>(h.beta1)), h.beta2,
                  static_cast<float>(1.0 - static_cast<double>(h.beta2)), h.eps,
                  h.decoupled ? 0.0f : h.weight_decay,
                  h.decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f,
                  static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2))};
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               float batch, const AdamHyper& h, const Tensor& clip, const Tensor& vmax) {
  const char* op = h.decoupled ? "adamw" : "adam";
  AdamStep body = adam_body(op, h, batch);
  for (const Tensor* t : {&param, &grad, &m, &v}) require_dtype(op, "tensor", *t, DType::F32);
  require_same_device(op, {&param, &grad, &m, &v});
  MGPU_CHECK_VALUE(grad.shape() == param.shape() && m.shape() == param.shape() &&
                   v.shape() == param.shape(), op, ": param ", param.shape(), ", grad ",
                   grad.shape(), " and the moments ", m.shape(), ", ", v.shape(),
                   " must have one shape");
  if (vmax.defined()) {
    require_dtype(op, "max_exp_avg_sq", vmax, DType::F32);
    require_same_device(op, {&param, &vmax});
    MGPU_CHECK_VALUE(vmax.shape() == param.shape(), op, ": amsgrad's max_exp_avg_sq has shape ",
                     vmax.shape(), " but the parameter has shape ", param.shape());
    body.vmax = vmax.f32();
  }
  body.param = param.f32();
  body.grad = grad.f32();
  body.m = m.f32();
  body.v = v.f32();
  body.clip = clip_pointer(op, param, clip);
  const int64_t n = param.numel();
  if (n == 0) return;
  dispatch(param.device(), op, [n, body] { in_blocks(n, body, &cpu::adam_step); },
           [n, body](cudaStream_t s) { cuda::for_each_index(n, body, s); }, param, grad, m, v,
           clip, vmax);
}

namespace cpu {

double sum_squares_blocks(int64_t n, const float* x) {
  const int64_t blocks = (n + kElementBlock - 1) / kElementBlock;
  if (blocks <= 1) return sum_squares(n, x);
  std::vector<double> partial(static_cast<size_t>(blocks));
  parallel_for(blocks, [&](int64_t b) {
    const int64_t at = b * kElementBlock;
    partial[static_cast<size_t>(b)] = sum_squares(std::min(n - at, kElementBlock), x + at);
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace cpu

Tensor sum_squares(const Tensor& x) {
  require_dtype("sum_squares", "x", x, DType::F32);
  if (!x.device().is_cpu()) return sum(binary(BinaryOp::Mul, x, x));
  // One task, nothing allocated: the squares summed in parallel blocks, in a fixed order.
  Tensor out = Tensor::empty({}, DType::F32, x.device());
  const float* src = x.f32();
  float* dst = out.f32();
  enqueue_on(x.device(), "sum_squares", [src, dst, n = x.numel()] {
    *dst = static_cast<float>(cpu::sum_squares_blocks(n, src));
  }, x, out);
  return out;
}

Tensor clip_factor(const Tensor& grad, float grad_scale, float max_norm) {
  // max_norm as Python checked it where the user gave it (nn_utils.check_max_norm).
  require_dtype("clip_grad_norm", "grad", grad, DType::F32);
  const Tensor squares = sum_squares(grad);
  Tensor factor = Tensor::empty({}, DType::F32, grad.device());
  for_each_index("clip_grad_norm", grad.device(), 1,
                 ClipFactor{squares.f32(), factor.f32(), grad_scale, max_norm}, squares, factor);
  return factor;
}

}  // namespace mgpu::ops
