// cpp/ops/relu.cpp -- validate, allocate, dispatch; nothing device-specific here.
#include "ops/relu.h"

namespace mgpu::ops {

Tensor relu_forward(const Tensor& x) {
  require_dtype("relu_forward", "x", x, DType::F32);
  Tensor y = Tensor::empty_like(x);
  for_each_index("relu_forward", x.device(), x.numel(), ReluOut{x.f32(), y.f32()}, x, y);
  return y;
}

Tensor relu_backward(const Tensor& x, const Tensor& dy) {
  require_dtype("relu_backward", "x", x, DType::F32);
  require_dtype("relu_backward", "dy", dy, DType::F32);
  MGPU_CHECK_VALUE(dy.shape() == x.shape(), "relu_backward: dy has shape ", dy.shape(),
                   " but x has shape ", x.shape());
  require_same_device("relu_backward", {&x, &dy});
  Tensor dx = Tensor::empty_like(x);
  for_each_index("relu_backward", x.device(), x.numel(),
                 ReluGradInput{x.f32(), dy.f32(), dx.f32()}, x, dy, dx);
  return dx;
}

}  // namespace mgpu::ops
