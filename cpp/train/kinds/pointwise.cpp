// cpp/train/kinds/pointwise.cpp -- the layers without parameters that act element by element or
// only on the shape: relu, dropout, add (two slots), flatten.
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/relu.h"
#include "train/layer_kind.h"

namespace mgpu::train {

const LayerDef relu_layer = [] {
  LayerDef d;
  d.name = "relu";
  // relu(x) > 0 exactly where x > 0 (NaN stays NaN), so the output gives the input's mask: the
  // batch norm or add output before it is freed in forward.
  d.keeps = Keeps::Output;
  d.forward = [](const LayerCall& c, Saved*) { return ops::relu_forward(c.in[0]); };
  d.backward = [](const LayerCall&, const Tensor& out, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    (*dx)[0] = ops::relu_backward(out, dy);
  };
  return d;
}();

const LayerDef dropout_layer = [] {
  LayerDef d;
  d.name = "dropout";
  d.options = {"p"};
  d.configure = [](Layer& l, const Options& o, const BuildContext&) {
    l.p = number_option(o, "p", l.p);
    MGPU_CHECK_VALUE(l.p >= 0 && l.p <= 1, l.name, ": p must be a probability in [0, 1], got ",
                     l.p);
  };
  d.keeps = Keeps::Nothing;  // backward recomputes the mask from the step's seed and rows
  d.forward = [](const LayerCall& c, Saved*) {
    return c.training ? ops::dropout_forward(c.in[0], c.key) : c.in[0];
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    (*dx)[0] = ops::dropout_backward(dy, c.key);
  };
  return d;
}();

const LayerDef add_layer = [] {
  LayerDef d;
  d.name = "add";
  d.inputs = 2;
  d.keeps = Keeps::Nothing;
  d.forward = [](const LayerCall& c, Saved*) {
    MGPU_CHECK_VALUE(c.in[0].shape() == c.in[1].shape(), c.l.name, ": adds slots ", c.l.in[0],
                     " and ", c.l.in[1], " of shapes ", c.in[0].shape(), " and ",
                     c.in[1].shape(), "; they must be equal");
    return ops::binary(ops::BinaryOp::Add, c.in[0], c.in[1]);
  };
  // Both operands get dy itself: nothing reads or writes it in place after this.
  d.backward = [](const LayerCall&, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    (*dx)[0] = dy;
    (*dx)[1] = dy;
  };
  return d;
}();

const LayerDef flatten_layer = [] {
  LayerDef d;
  d.name = "flatten";
  // Backward re-reads its input, for the shape.
  d.forward = [](const LayerCall& c, Saved*) {
    const Tensor& x = c.in[0];
    MGPU_CHECK_VALUE(x.dim() >= 1, c.l.name, ": cannot flatten a 0-d tensor");
    return x.reshape({x.size(0), -1});
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    (*dx)[0] = dy.reshape(c.in[0].shape());
  };
  return d;
}();

}  // namespace mgpu::train
