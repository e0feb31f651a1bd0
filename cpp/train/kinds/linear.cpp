// cpp/train/kinds/linear.cpp -- the fully connected layer: y = x W (+ b) with W (in, out), or
// y = x W^T (+ b) with W (out, in) when transposed (PyTorch's layout, which Python's Linear uses).
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/precision.h"
#include "train/layer_kind.h"

namespace mgpu::train {

const LayerDef linear_layer = [] {
  LayerDef d;
  d.name = "linear";
  d.options = {"bias", "transpose", "bf16", "round_db"};
  d.configure = [](Layer& l, const Options& o, const BuildContext&) {
    l.bias = flag_option(o, "bias", true);
    l.transpose = flag_option(o, "transpose", false);
    l.precision = flag_option(o, "bf16", false) ? ops::Precision::BF16 : ops::Precision::F32;
    l.round_db = flag_option(o, "round_db", false);
  };
  d.owns = [](const Layer& l) { return std::pair<int, int>{l.bias ? 2 : 1, 0}; };
  d.check_shapes = [](const Layer& l, const Shapes& ps, const Shapes&) {
    const Shape& w = ps[static_cast<size_t>(l.params[0])];
    MGPU_CHECK_VALUE(w.size() == 2, l.name, ": the weight must have 2 dims, got shape ", w);
    if (l.params.size() > 1)
      check_vector_shape(l, ps[static_cast<size_t>(l.params[1])], w[l.transpose ? 0 : 1],
                         "the bias");
  };
  d.forward = [](const LayerCall& c, Saved*) {
    const Layer& l = c.l;
    const Tensor& x = c.in[0];
    MGPU_CHECK_VALUE(x.dim() == 2, l.name, ": expects (N, features), got shape ", x.shape(),
                     "; put a flatten layer before it");
    const int64_t fan_in = c.param(0).size(l.transpose ? 1 : 0);
    MGPU_CHECK_VALUE(x.size(1) == fan_in, l.name, ": the input has ", x.size(1),
                     " features but the weight ", c.param(0).shape(), " expects ", fan_in);
    Tensor z = ops::mm(x, c.param(0), false, l.transpose, l.precision);
    return l.bias ? ops::binary(ops::BinaryOp::Add, z, c.param(1)) : z;
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>& need_dx, std::vector<Tensor>* dx,
                  std::vector<Tensor>* dp) {
    const Layer& l = c.l;
    const Tensor& x = c.in[0];
    const ops::Precision pr = l.precision;
    Tensor dW = l.transpose ? ops::mm(dy, x, true, false, pr) : ops::mm(x, dy, true, false, pr);
    if (need_dx[0]) (*dx)[0] = ops::mm(dy, c.param(0), false, !l.transpose, pr);
    *dp = {dW};
    // round_db (bf16): the bias gradient sums dy rounded to bfloat16, the dy the products see
    // (as conv2d's db does, and PyTorch's F.linear under autocast).
    if (l.bias) {
      const Tensor g = pr == ops::Precision::BF16 && l.round_db ? ops::bf16_round(dy) : dy;
      dp->push_back(ops::sum_to_shape(g, c.param(1).shape()));
    }
  };
  return d;
}();

}  // namespace mgpu::train
