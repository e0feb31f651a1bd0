// cpp/bind/bind_ops.cpp -- the ops, forward and backward, plus all-reduce and split.
#include <pybind11/numpy.h>

#include <optional>
#include <tuple>

#include "bind/bind.h"
#include "comm/allreduce.h"
#include "comm/stream_sum.h"
#include "ops/argmax.h"
#include "ops/avg_pool2d.h"
#include "ops/batch_norm.h"
#include "ops/conv2d.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/max_pool2d.h"
#include "ops/precision.h"
#include "ops/relu.h"
#include "ops/softmax_ce.h"
#include "train/split_batch.h"

namespace py = pybind11;

namespace mgpu::bind {

void bind_ops(py::module_& m) {
  using ops::BinaryOp;
  // Ops may block while their device's queue is full, so they run without the GIL.
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::enum_<BinaryOp>(m, "BinaryOp")
      .value("Add", BinaryOp::Add).value("Sub", BinaryOp::Sub)
      .value("Mul", BinaryOp::Mul).value("Div", BinaryOp::Div);

  m.def("binary", &ops::binary, nogil(), "a op b (equal shapes or a row-broadcast operand).");
  m.def("binary_scalar", &ops::binary_scalar, nogil(), "a op s, or s op a when scalar_first.");
  m.def("binary_inplace", &ops::binary_inplace, nogil(), "a op= b in place.");
  m.def("binary_scalar_inplace", &ops::binary_scalar_inplace, nogil(), "a op= s in place.");
  m.def("sum_to_shape", &ops::sum_to_shape, nogil(), "dy summed over leading axes down to shape.");
  m.def("sum", &ops::sum, nogil(), "Sum of all elements as a 0-d tensor.");
  m.def("fill", &ops::fill, nogil(), "Sets every element to a value.");
  m.def("copy", &ops::copy, nogil(), "dst[...] = src[...] across any two devices.");
  m.def("to_device", &ops::to_device, py::arg("src"), py::arg("device"),
        py::arg("force_copy") = false, nogil(), "A copy of src on device (src itself if already there).");
  m.def("astype", [](const Tensor& x, const std::string& name) {
    for (DType t : {DType::F32, DType::I32, DType::I64, DType::U8, DType::BF16})
      if (name == dtype_name(t)) return ops::astype(x, t);
    throw TypeError("astype: unknown dtype '" + name +
                    "'; use float32, bfloat16, int32, int64 or uint8");
  }, nogil(), "Elementwise dtype conversion.");
  m.def("sgd_update", [](const Tensor& param, const Tensor& grad, float scale) {
    ops::SgdHyper h;
    h.lr = scale;
    ops::sgd_step(param, grad, Tensor(), 1.0f, h);
  }, py::arg("param"), py::arg("grad"), py::arg("scale"), nogil(), "param -= scale * grad.");
  m.def("sgd_step", [](const Tensor& param, const Tensor& grad,
                       const std::optional<Tensor>& momentum_buffer, float lr, float momentum,
                       float dampening, float weight_decay, bool nesterov, bool first) {
    ops::SgdHyper h;
    h.lr = lr;
    h.momentum = momentum;
    h.dampening = dampening;
    h.weight_decay = weight_decay;
    h.nesterov = nesterov;
    h.first = first;
    ops::sgd_step(param, grad, momentum_buffer.value_or(Tensor()), 1.0f, h);
  }, py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"), py::arg("lr"),
     py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
     py::arg("first"), nogil(),
     "PyTorch's SGD step on param (and momentum_buffer, None for none) in place; first: the "
     "buffer's first step (buf = g).");
  m.def("adam_step", [](const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                        const Tensor& exp_avg_sq, float lr, std::pair<float, float> betas, float eps,
                        float weight_decay, bool decoupled, int64_t step,
                        const std::optional<Tensor>& max_exp_avg_sq) {
    ops::AdamHyper h;
    h.lr = lr;
    h.beta1 = betas.first;
    h.beta2 = betas.second;
    h.eps = eps;
    h.weight_decay = weight_decay;
    h.decoupled = decoupled;
    h.step = step;
    ops::adam_step(param, grad, exp_avg, exp_avg_sq, 1.0f, h, Tensor(),
                   max_exp_avg_sq.value_or(Tensor()));
  }, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
     py::arg("betas"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
     py::arg("step"), py::arg("max_exp_avg_sq") = std::nullopt, nogil(),
     "PyTorch's Adam (AdamW when decoupled) step t on param, exp_avg and exp_avg_sq in place; "
     "with max_exp_avg_sq amsgrad (that tensor too).");
  m.def("sum_squares", &ops::sum_squares, py::arg("x"), nogil(),
        "The sum of x * x (float products added in double) as a 0-d float32 tensor, in the order "
        "of the fused step's clipping norm.");
  m.def("_sum_squares_blocks",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
          const float* data = x.data();
          const int64_t n = x.size();
          py::gil_scoped_release released;
          return ops::cpu::sum_squares_blocks(n, data);
        }, py::arg("x"),
        "Tests only: cpu::sum_squares_blocks of a float32 array on this thread's share of "
        "cores, the double before sum_squares rounds it to float32.");
  m.def("relu_forward", &ops::relu_forward, nogil(), "max(x, 0).");
  m.def("relu_backward", &ops::relu_backward, nogil(), "dx = dy where x > 0.");
  m.def("dropout_forward", [](const Tensor& x, double p, uint64_t seed, uint32_t stream,
                              int64_t first_row) {
    return ops::dropout_forward(x, ops::DropoutKey{seed, stream, first_row, p});
  }, py::arg("x"), py::arg("p"), py::arg("seed"), py::arg("stream"), py::arg("first_row"),
        nogil(), "x * mask, the mask a function of (seed, stream, first_row + row, element).");
  m.def("dropout_backward", [](const Tensor& dy, double p, uint64_t seed, uint32_t stream,
                               int64_t first_row) {
    return ops::dropout_backward(dy, ops::DropoutKey{seed, stream, first_row, p});
  }, py::arg("dy"), py::arg("p"), py::arg("seed"), py::arg("stream"), py::arg("first_row"),
        nogil(), "dx = dy * the forward's mask, recomputed from the same counters.");
  m.def("conv2d_forward", [](const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                             int64_t stride, int64_t pad, const std::string& precision) {
    return ops::conv2d_forward(x, w, b.value_or(Tensor()), stride, pad,
                               ops::conv_algo_for(x.device()), ops::parse_precision(precision));
  }, py::arg("x"), py::arg("w"), py::arg("b"), py::arg("stride"), py::arg("pad"),
     py::arg("precision") = "float32", nogil(),
     "2-D cross-correlation with stride and padding (b may be None); precision 'float32' or "
     "'bf16' (bfloat16 products, float32 sums).");
  m.def("conv2d_backward", [](const Tensor& x, const Tensor& w, const Tensor& dy, int64_t stride,
                              int64_t pad, bool need_dx, bool has_bias,
                              const std::string& precision) {
    ops::Conv2dGrads g = ops::conv2d_backward(x, w, dy, stride, pad, need_dx, has_bias,
                                              ops::conv_algo_for(x.device()),
                                              ops::parse_precision(precision));
    auto opt = [](const Tensor& t) {
      return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
    };
    return std::make_tuple(opt(g.dx), g.dw, opt(g.db));
  }, py::arg("x"), py::arg("w"), py::arg("dy"), py::arg("stride"), py::arg("pad"),
     py::arg("need_dx"), py::arg("has_bias"), py::arg("precision") = "float32", nogil(),
     "(dx or None, dw, db or None).");
  m.def("avg_pool2d_forward", &ops::avg_pool2d_forward, nogil(), "Average pooling, floor output size.");
  m.def("avg_pool2d_backward", &ops::avg_pool2d_backward, nogil(), "dx of average pooling.");
  m.def("max_pool2d_forward", [](const Tensor& x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                 int64_t ph, int64_t pw, bool keep_indices) {
    ops::MaxPool2d r = ops::max_pool2d_forward(x, kh, kw, sh, sw, ph, pw, keep_indices);
    return std::make_pair(r.y, r.indices.defined() ? std::optional<Tensor>(r.indices)
                                                   : std::nullopt);
  }, py::arg("x"), py::arg("kh"), py::arg("kw"), py::arg("sh"), py::arg("sw"), py::arg("ph"),
        py::arg("pw"), py::arg("keep_indices") = true, nogil(),
        "(y, int32 argmax indices or None) of max pooling with -inf padding, floor output size.");
  m.def("max_pool2d_backward", &ops::max_pool2d_backward, py::arg("indices"), py::arg("dy"),
        py::arg("H"), py::arg("W"), py::arg("kh"), py::arg("kw"), py::arg("sh"), py::arg("sw"),
        py::arg("ph"), py::arg("pw"), nogil(), "dx of max pooling: dy added at forward's indices.");
  auto opt_ptr = [](const std::optional<Tensor>& t) { return t ? &*t : nullptr; };
  m.def("batch_norm_stats", &ops::batch_norm_stats, py::arg("x"), nogil(),
        "(mean, biased var) per channel of x (N, C, H, W) or (N, C).");
  m.def("batch_norm_combine_stats",
        py::overload_cast<const std::vector<Tensor>&, const std::vector<Tensor>&,
                          const std::vector<double>&, Device>(&ops::batch_norm_combine_stats),
        py::arg("means"), py::arg("variances"), py::arg("counts"), py::arg("device"), nogil(),
        "(mean, biased var) of the union of replicas' (count, mean, var), combined on device in "
        "double (Chan et al.), as the fused step's synchronised batch norm combines them.");
  m.def("batch_norm_combine_sums",
        py::overload_cast<const std::vector<Tensor>&, const std::vector<Tensor>&, Device>(
            &ops::batch_norm_combine_sums),
        py::arg("sum_dys"), py::arg("sum_dy_xhats"), py::arg("device"), nogil(),
        "(sum_dy, sum_dy_xhat) over every replica, added on device in double in replica order, "
        "as the fused step's synchronised batch norm adds them.");
  m.def("batch_norm_update_running", &ops::batch_norm_update_running, py::arg("running"),
        py::arg("batch"), py::arg("keep"), py::arg("step"), nogil(),
        "running = running * keep + batch * step in place (the running statistics' update).");
  m.def("batch_norm_forward", [opt_ptr](const Tensor& x, const Tensor& mean, const Tensor& var,
                                        const std::optional<Tensor>& gamma,
                                        const std::optional<Tensor>& beta, float eps) {
    return ops::batch_norm_forward(x, mean, var, opt_ptr(gamma), opt_ptr(beta), eps);
  }, py::arg("x"), py::arg("mean"), py::arg("var"), py::arg("gamma"), py::arg("beta"),
        py::arg("eps"), nogil(), "(x - mean) / sqrt(var + eps) * gamma + beta (gamma, beta may be None).");
  m.def("batch_norm_backward_reduce", &ops::batch_norm_backward_reduce, py::arg("x"),
        py::arg("dy"), py::arg("mean"), py::arg("var"), py::arg("eps"), nogil(),
        "(sum_dy, sum_dy_xhat) per channel: dbeta and dgamma.");
  m.def("batch_norm_backward", [opt_ptr](const Tensor& x, const Tensor& dy, const Tensor& mean,
                                         const Tensor& var, const std::optional<Tensor>& gamma,
                                         const Tensor& sum_dy, const Tensor& sum_dy_xhat,
                                         double count, float eps, bool training) {
    return ops::batch_norm_backward(x, dy, mean, var, opt_ptr(gamma), sum_dy, sum_dy_xhat, count,
                                    eps, training);
  }, py::arg("x"), py::arg("dy"), py::arg("mean"), py::arg("var"), py::arg("gamma"),
        py::arg("sum_dy"), py::arg("sum_dy_xhat"), py::arg("count"), py::arg("eps"),
        py::arg("training"), nogil(), "dx of batch norm (training: statistics depend on x).");
  m.def("batch_norm_act_forward", [opt_ptr](const Tensor& x, const Tensor& mean,
                                            const Tensor& var, const std::optional<Tensor>& gamma,
                                            const std::optional<Tensor>& beta,
                                            const std::optional<Tensor>& shortcut, float eps) {
    return ops::batch_norm_act_forward(x, mean, var, opt_ptr(gamma), opt_ptr(beta),
                                       opt_ptr(shortcut), eps);
  }, py::arg("x"), py::arg("mean"), py::arg("var"), py::arg("gamma"), py::arg("beta"),
        py::arg("shortcut"), py::arg("eps"), nogil(),
        "relu(batch_norm_forward(...) + shortcut) in one pass (shortcut may be None).");
  m.def("batch_norm_act_backward_reduce", &ops::batch_norm_act_backward_reduce, py::arg("x"),
        py::arg("y"), py::arg("dy"), py::arg("mean"), py::arg("var"), py::arg("eps"), nogil(),
        "(sum_dz, sum_dz_xhat) per channel with dz = dy where y > 0.");
  m.def("batch_norm_act_backward", [opt_ptr](const Tensor& x, const Tensor& y, const Tensor& dy,
                                             const Tensor& mean, const Tensor& var,
                                             const std::optional<Tensor>& gamma,
                                             const Tensor& sum_dz, const Tensor& sum_dz_xhat,
                                             double count, float eps, bool want_dshortcut) {
    auto [dx, dsc] = ops::batch_norm_act_backward(x, y, dy, mean, var, opt_ptr(gamma), sum_dz,
                                                  sum_dz_xhat, count, eps, want_dshortcut);
    return std::make_pair(dx, dsc.defined() ? std::optional<Tensor>(dsc) : std::nullopt);
  }, py::arg("x"), py::arg("y"), py::arg("dy"), py::arg("mean"), py::arg("var"), py::arg("gamma"),
        py::arg("sum_dz"), py::arg("sum_dz_xhat"), py::arg("count"), py::arg("eps"),
        py::arg("want_dshortcut"), nogil(),
        "(dx, dshortcut or None) of relu(batch_norm(x) (+ shortcut)) in training mode.");
  m.def("batch_norm_backward_full", [opt_ptr](const Tensor& x, const std::optional<Tensor>& y,
                                              const Tensor& dy, const Tensor& mean,
                                              const Tensor& var,
                                              const std::optional<Tensor>& gamma, float eps,
                                              bool want_dx, bool want_dshortcut) {
    ops::BatchNormGrads g = ops::batch_norm_backward_full(x, opt_ptr(y), dy, mean, var,
                                                          opt_ptr(gamma), eps, want_dx,
                                                          want_dshortcut);
    auto opt = [](const Tensor& t) {
      return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
    };
    return std::make_tuple(g.sum_dy, g.sum_dy_xhat, opt(g.dx), opt(g.dshortcut));
  }, py::arg("x"), py::arg("y"), py::arg("dy"), py::arg("mean"), py::arg("var"), py::arg("gamma"),
        py::arg("eps"), py::arg("want_dx"), py::arg("want_dshortcut"), nogil(),
        "(sum_dz, sum_dz_xhat, dx or None, dshortcut or None) of batch norm (+ relu if y is the "
        "saved relu output) in training mode with the batch's own statistics, in one op.");
  m.def("mm", [](const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                 const std::string& precision) {
    return ops::mm(a, b, trans_a, trans_b, ops::parse_precision(precision));
  }, py::arg("a"), py::arg("b"), py::arg("trans_a") = false, py::arg("trans_b") = false,
     py::arg("precision") = "float32", nogil(),
     "Matrix product op(a) @ op(b); precision 'float32' or 'bf16' (bfloat16 operands, float32 "
     "sums).");
  m.def("bf16_round", &ops::bf16_round, py::arg("x"), nogil(),
        "x rounded to bfloat16 (nearest even, as the bf16 products round), as float32.");
  m.def("bf16_kernel", &ops::bf16_kernel,
        "The bf16 products' CPU kernel: 'avx512_bf16' (vdpbf16ps), 'avx512' or 'avx2' (float32 "
        "FMAs on bfloat16-rounded values; the same bits).");
  m.def("softmax_ce_forward", &ops::softmax_ce_forward, nogil(), "Per-example softmax cross-entropy.");
  m.def("softmax_ce_backward", &ops::softmax_ce_backward, nogil(), "(softmax - onehot) * dloss.");
  m.def("argmax", &ops::argmax, nogil(), "Index of the maximum along the last axis.");
  m.def("correct_count", &ops::correct_count, nogil(), "Rows whose argmax equals the label (0-d).");
  m.def("allreduce", [](const std::vector<std::vector<Tensor>>& data) {
    comm::allreduce(data);
  }, nogil(), "In-place sum across devices; data[d] is device d's list of tensors.");
  m.def("_stream_sum", [](const std::vector<Tensor>& parts) {
    MGPU_CHECK_VALUE(parts.size() >= 2, "_stream_sum: needs 2 or more tensors, got ", parts.size());
    std::vector<Device> devices;
    for (const Tensor& t : parts) {
      MGPU_CHECK_VALUE(!t.device().is_cpu() && t.dtype() == DType::F32 && t.dim() == 1 &&
                       t.numel() == parts[0].numel(), "_stream_sum: expects 1-D float32 tensors "
                       "of one size, one per GPU, got ", t.shape(), " on ", t.device());
      devices.push_back(t.device());
    }
    for (size_t i = 0; i < devices.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        MGPU_CHECK_VALUE(devices[i] != devices[j], "_stream_sum: ", devices[i], " appears twice");
    comm::stream_sum_gpu(parts, devices);
  }, nogil(), "In-place sum of one 1-D float32 tensor per GPU, on the GPUs' streams (the "
     "exchange of synchronised batch norm; tests).");
  m.def("split_rows", &train::split_rows, nogil(), "Shards along axis 0, one per device, copied there.");
}

}  // namespace mgpu::bind
