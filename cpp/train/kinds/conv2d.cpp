// cpp/train/kinds/conv2d.cpp -- the conv layers: conv2d, and conv2d_relu_pool (LeNet's conv, relu
// and average pooling, one CPU kernel when the build chose it).
#include "ops/avg_pool2d.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/relu.h"
#include "train/layer_kind.h"

namespace mgpu::train {
namespace {

void check_conv_shapes(const Layer& l, const Shapes& ps, const Shapes& bs) {
  const Shape& w = ps[static_cast<size_t>(l.params[0])];
  MGPU_CHECK_VALUE(w.size() == 4, l.name, ": the weight must have 4 dims (K, C, R, S), got shape ",
                   w);
  if (l.params.size() > 1)
    check_vector_shape(l, ps[static_cast<size_t>(l.params[1])], w[0], "the bias");
}

Tensor conv2d_forward(const LayerCall& c, Saved*) {
  const Layer& l = c.l;
  return ops::conv2d_forward(c.in[0], c.param(0), l.bias ? c.param(1) : Tensor(), l.stride,
                             l.padding, l.conv_algo, l.precision);
}

void conv2d_backward(const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                     const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
                     std::vector<Tensor>* dp) {
  const Layer& l = c.l;
  ops::Conv2dGrads g = ops::conv2d_backward(c.in[0], c.param(0), dy, l.stride, l.padding,
                                            need_dx[0], l.bias, l.conv_algo, l.precision);
  (*dx)[0] = g.dx;
  *dp = l.bias ? std::vector<Tensor>{g.dw, g.db} : std::vector<Tensor>{g.dw};
}

// Whether the fused kernel takes these shapes. A layer built with it (Layer::fused_kernel: CPU
// replicas) runs it when they fit (bf16: and where it gives the three ops' bits); for shapes that do not, it runs conv2d, relu and
// avg_pool2d, whose checks then report the problem.
bool fused_fits(const Tensor& x, const Tensor& w, int64_t pool) {
  if (x.dim() != 4 || x.size(1) != w.size(1)) return false;
  const int64_t p = x.size(2) - w.size(2) + 1, q = x.size(3) - w.size(3) + 1;
  return p >= pool && q >= pool;
}

// Keeps the fused kernel's relu mask in s->a, or the unfused path's conv output (a) and relu
// output (b).
Tensor conv2d_relu_pool_forward(const LayerCall& c, Saved* s) {
  const Layer& l = c.l;
  const Tensor& x = c.in[0];
  // The Model chose the kernel (GPUs: the conv alone, then relu and the pool); in bf16 it runs
  // where it gives the three ops' bits (ops::conv2d_relu_pool_takes_bf16).
  if (l.fused_kernel && fused_fits(x, c.param(0), l.kh) &&
      (l.precision == ops::Precision::F32 ||
       ops::conv2d_relu_pool_takes_bf16(x, c.param(0), l.kh, l.conv_algo))) {
    ops::Conv2dReluPool f = ops::conv2d_relu_pool_forward(x, c.param(0), c.param(1), 1, 0, l.kh,
                                                          c.for_backward, l.precision);
    s->a = f.mask;
    return f.pooled;
  }
  s->a = ops::conv2d_forward(x, c.param(0), c.param(1), 1, 0, l.conv_algo, l.precision);
  s->b = ops::relu_forward(s->a);
  return ops::avg_pool2d_forward(s->b, l.kh, l.kh, l.kh, l.kh);
}

void conv2d_relu_pool_backward(const LayerCall& c, const Tensor&, const Tensor& dy,
                               const Saved& s, const std::vector<bool>& need_dx,
                               std::vector<Tensor>* dx, std::vector<Tensor>* dp) {
  const Layer& l = c.l;
  const Tensor& x = c.in[0];
  ops::Conv2dGrads g;
  if (!s.b.defined()) {
    g = ops::conv2d_relu_pool_backward(x, c.param(0), s.a, dy, 1, 0, l.kh, need_dx[0],
                                       l.precision);
  } else {
    Tensor da = ops::avg_pool2d_backward(s.b, dy, l.kh, l.kh, l.kh, l.kh);
    Tensor dc = ops::relu_backward(s.a, da);
    g = ops::conv2d_backward(x, c.param(0), dc, 1, 0, need_dx[0], true, l.conv_algo,
                             l.precision);
  }
  (*dx)[0] = g.dx;
  *dp = {g.dw, g.db};
}

ops::Precision precision_option(const Options& o) {
  return flag_option(o, "bf16", false) ? ops::Precision::BF16 : ops::Precision::F32;
}

}  // namespace

const LayerDef conv2d_layer = [] {
  LayerDef d;
  d.name = "conv2d";
  d.options = {"stride", "padding", "bias", "bf16"};
  d.configure = [](Layer& l, const Options& o, const BuildContext& ctx) {
    l.bias = flag_option(o, "bias", true);
    l.precision = precision_option(o);
    l.conv_algo = ctx.conv_algo;
    l.stride = int_option(l, o, "stride", 1, 1);
    l.padding = int_option(l, o, "padding", 0, 0);
  };
  d.owns = [](const Layer& l) { return std::pair<int, int>{l.bias ? 2 : 1, 0}; };
  d.check_shapes = check_conv_shapes;
  d.forward = conv2d_forward;
  d.backward = conv2d_backward;
  d.conv = true;
  return d;
}();

const LayerDef conv2d_relu_pool_layer = [] {
  LayerDef d;
  d.name = "conv2d_relu_pool";
  d.options = {"pool", "bf16"};
  d.configure = [](Layer& l, const Options& o, const BuildContext& ctx) {
    l.precision = precision_option(o);
    l.conv_algo = ctx.conv_algo;
    l.kh = l.kw = l.sh = l.sw = int_option(l, o, "pool", 2, 1);
    l.fused_kernel = ctx.on_cpu;  // its kernel's domain (bf16: where it takes the shape)
  };
  d.owns = [](const Layer&) { return std::pair<int, int>{2, 0}; };
  d.check_shapes = check_conv_shapes;
  d.forward = conv2d_relu_pool_forward;
  d.backward = conv2d_relu_pool_backward;
  d.kernels = [](const Layer& l) {
    if (!l.fused_kernel) return std::string("conv2d, relu, avg_pool2d");
    return std::string(l.precision == ops::Precision::F32
                           ? "conv2d_relu_pool"
                           : "conv2d_relu_pool on bfloat16-rounded operands where float32's rule "
                             "runs the conv, else conv2d, relu, avg_pool2d");
  };
  d.conv = true;
  return d;
}();

}  // namespace mgpu::train
