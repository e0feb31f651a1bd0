// cpp/train/kinds/pool.cpp -- the pooling layers: avg_pool2d, max_pool2d (square windows) and
// global_avg_pool (a whole plane to one value).
#include "ops/avg_pool2d.h"
#include "ops/max_pool2d.h"
#include "train/layer_kind.h"

namespace mgpu::train {
namespace {

// The window (option kernel, required) and its stride (default: the window).
void configure_window(Layer& l, const Options& o) {
  MGPU_CHECK_VALUE(o.count("kernel"), l.name, ": give the pooling window as option 'kernel'");
  l.kh = l.kw = int_option(l, o, "kernel", 2, 1);
  l.sh = l.sw = int_option(l, o, "stride", l.kh, 1);
}

void check_planes(const Layer& l, const Tensor& x) {
  MGPU_CHECK_VALUE(x.dim() == 4, l.name, ": expects (N, C, H, W), got shape ", x.shape());
}

}  // namespace

const LayerDef avg_pool2d_layer = [] {
  LayerDef d;
  d.name = "avg_pool2d";
  d.options = {"kernel", "stride"};
  d.configure = [](Layer& l, const Options& o, const BuildContext&) { configure_window(l, o); };
  // Backward re-reads its input, for the shape.
  d.forward = [](const LayerCall& c, Saved*) {
    const Layer& l = c.l;
    return ops::avg_pool2d_forward(c.in[0], l.kh, l.kw, l.sh, l.sw);
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    const Layer& l = c.l;
    (*dx)[0] = ops::avg_pool2d_backward(c.in[0], dy, l.kh, l.kw, l.sh, l.sw);
  };
  return d;
}();

const LayerDef max_pool2d_layer = [] {
  LayerDef d;
  d.name = "max_pool2d";
  d.options = {"kernel", "stride", "padding"};
  d.configure = [](Layer& l, const Options& o, const BuildContext&) {
    l.padding = int_option(l, o, "padding", 0, 0);
    configure_window(l, o);
  };
  d.keeps = Keeps::Nothing;  // only the indices, in Saved
  d.forward = [](const LayerCall& c, Saved* s) {
    const Layer& l = c.l;
    const Tensor& x = c.in[0];
    check_planes(l, x);
    ops::MaxPool2d f = ops::max_pool2d_forward(x, l.kh, l.kw, l.sh, l.sw, l.padding, l.padding,
                                               c.for_backward);
    s->a = f.indices;
    s->h = x.size(2), s->w = x.size(3);
    return f.y;
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved& s,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    const Layer& l = c.l;
    (*dx)[0] = ops::max_pool2d_backward(s.a, dy, s.h, s.w, l.kh, l.kw, l.sh, l.sw, l.padding,
                                        l.padding);
  };
  return d;
}();

const LayerDef global_avg_pool_layer = [] {
  LayerDef d;
  d.name = "global_avg_pool";
  // Backward re-reads its input, for the shape.
  d.forward = [](const LayerCall& c, Saved*) {
    const Tensor& x = c.in[0];
    check_planes(c.l, x);
    return ops::avg_pool2d_forward(x, x.size(2), x.size(3), x.size(2), x.size(3));
  };
  d.backward = [](const LayerCall& c, const Tensor&, const Tensor& dy, const Saved&,
                  const std::vector<bool>&, std::vector<Tensor>* dx, std::vector<Tensor>*) {
    const Tensor& x = c.in[0];
    (*dx)[0] = ops::avg_pool2d_backward(x, dy, x.size(2), x.size(3), x.size(2), x.size(3));
  };
  return d;
}();

}  // namespace mgpu::train
