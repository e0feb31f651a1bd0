"""The chapters' networks: 12.5's LeNet written op by op (``lenet``, ``lenet_params``), the same
LeNet as modules (``LeNet``), and 12.6's ``Residual`` and ``resnet18`` as d2l defines them.

Shapes: X (N, 1, 28, 28) Fashion-MNIST images -> logits (N, 10).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .nn import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Flatten,
    Linear,
    Module,
    ReLU,
    Sequential,
)
from .ops import avg_pool2d, conv2d, mm, relu
from .random import normal
from .tensor import Tensor, array, zeros

# --- the chapter's LeNet (sec. 12.5.1) ----------------------------------------------------
LENET_SHAPES: List[Tuple[int, ...]] = [
    (20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def lenet_params(scale: float = 0.01, seed: Optional[int] = None, device=None) -> List[Tensor]:
    """The chapter's parameters [W1, b1, W2, b2, W3, b3, W4, b4]: weights N(0, scale^2), biases 0.

    With ``seed`` the draw is reproducible and leaves mgpu.random's global state alone.
    """
    rng = np.random.default_rng(seed) if seed is not None else None
    params = []
    for shape in LENET_SHAPES:
        if len(shape) == 1:
            params.append(zeros(shape, device=device))
        else:
            params.append(normal(scale=scale, size=shape, device=device, rng=rng))
    return params


def lenet(X: Tensor, params: Sequence[Tensor]) -> Tensor:
    """The chapter's LeNet: X (N, 1, 28, 28) -> logits (N, 10), written op by op."""
    if len(params) != len(LENET_SHAPES):
        raise ValueError(f"lenet: LeNet takes {len(LENET_SHAPES)} parameter arrays [W1, b1, W2, "
                         f"b2, W3, b3, W4, b4], got {len(params)}")
    h1_conv = conv2d(X, params[0], params[1])
    h1_activation = relu(h1_conv)
    h1 = avg_pool2d(h1_activation, kernel_size=(2, 2), stride=(2, 2))
    h2_conv = conv2d(h1, params[2], params[3])
    h2_activation = relu(h2_conv)
    h2 = avg_pool2d(h2_activation, kernel_size=(2, 2), stride=(2, 2))
    h2 = h2.reshape(h2.shape[0], -1)
    h3_linear = mm(h2, params[4]) + params[5]
    h3 = relu(h3_linear)
    y_hat = mm(h3, params[6]) + params[7]
    return y_hat


def _lenet_modules() -> Sequential:
    return Sequential(OrderedDict([
        ("conv1", Conv2d(1, 20, kernel_size=3)), ("relu1", ReLU()),
        ("pool1", AvgPool2d(kernel_size=2, stride=2)),
        ("conv2", Conv2d(20, 50, kernel_size=5)), ("relu2", ReLU()),
        ("pool2", AvgPool2d(kernel_size=2, stride=2)),
        ("flatten", Flatten()),
        ("fc1", Linear(800, 128)), ("relu3", ReLU()),
        ("fc2", Linear(128, 10))]))


class LeNet(Sequential):
    """The chapter's LeNet as modules: ``LeNet()(X)`` equals ``lenet(X, params)`` when the
    modules hold the same parameters.

    ``lenet`` keeps dense weights as (in, out) and computes ``mm(X, W) + b``; ``Linear`` keeps
    them as (out, in), PyTorch's layout. :meth:`from_params` and :meth:`to_params` convert
    between the two (transposing the dense weights), so both chapters' code share parameters.
    """

    def __init__(self):
        super().__init__(_lenet_modules()._modules)

    @classmethod
    def from_params(cls, params: Sequence[Tensor]) -> "LeNet":
        """A LeNet holding copies of ``lenet_params``-style [W1, b1, W2, b2, W3, b3, W4, b4]."""
        if len(params) != len(LENET_SHAPES):
            raise ValueError(f"LeNet.from_params: expected {len(LENET_SHAPES)} arrays [W1, b1, W2, "
                             f"b2, W3, b3, W4, b4], got {len(params)}")
        host = [np.asarray(p.numpy() if isinstance(p, Tensor) else p, dtype=np.float32)
                for p in params]
        for i, (h, shape) in enumerate(zip(host, LENET_SHAPES)):
            if h.shape != shape:
                raise ValueError(f"LeNet.from_params: params[{i}] has shape {h.shape}, LeNet's "
                                 f"is {shape}")
        net = cls()
        dev = params[0].device if isinstance(params[0], Tensor) else None
        if dev is not None:
            net.to(dev)
        net.load_state_dict(OrderedDict([
            ("conv1.weight", host[0]), ("conv1.bias", host[1]),
            ("conv2.weight", host[2]), ("conv2.bias", host[3]),
            ("fc1.weight", np.ascontiguousarray(host[4].T)), ("fc1.bias", host[5]),
            ("fc2.weight", np.ascontiguousarray(host[6].T)), ("fc2.bias", host[7])]))
        return net

    def to_params(self) -> List[Tensor]:
        """The parameters in ``lenet``'s layout (copies; dense weights transposed to (in, out))."""
        dev = self.conv1.weight.device
        out = []
        for name in ("conv1", "conv2", "fc1", "fc2"):
            m = getattr(self, name)
            w = m.weight.numpy()
            out.append(array(w.T if name.startswith("fc") else w, device=dev))
            out.append(m.bias.copyto(dev))
        return out


# --- ResNet-18 (sec. 12.6, d2l's slightly modified version) -----------------------------------

class Residual(Module):
    """d2l's residual block: two 3x3 convolutions with BatchNorm and ReLU, and a shortcut that
    is a 1x1 convolution (``use_1x1conv``) when the shape changes.
    (N, input_channels, H, W) -> (N, num_channels, H / strides, W / strides)."""

    def __init__(self, input_channels: int, num_channels: int, use_1x1conv: bool = False,
                 strides: int = 1):
        super().__init__()
        self.conv1 = Conv2d(input_channels, num_channels, kernel_size=3, padding=1,
                            stride=strides)
        self.conv2 = Conv2d(num_channels, num_channels, kernel_size=3, padding=1)
        if use_1x1conv:
            self.conv3 = Conv2d(input_channels, num_channels, kernel_size=1, stride=strides)
        else:
            self.conv3 = None
        self.bn1 = BatchNorm2d(num_channels)
        self.bn2 = BatchNorm2d(num_channels)

    def forward(self, X: Tensor) -> Tensor:
        Y = relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        Y = Y + X
        return relu(Y)


def resnet_block(in_channels: int, out_channels: int, num_residuals: int,
                 first_block: bool = False) -> Sequential:
    """``num_residuals`` Residual blocks; the first halves the image and changes the channels
    unless ``first_block``."""
    blk = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blk.append(Residual(out_channels, out_channels))
    return Sequential(*blk)


def resnet18(num_classes: int, in_channels: int = 1) -> Sequential:
    """d2l's slightly modified ResNet-18: a 3x3 stem (stride 1, no max-pool), four stages of two
    Residual blocks (64, 128, 256, 512 channels), global average pooling and a Linear layer.
    (N, in_channels, H, W) -> (N, num_classes); 28x28 images end at 4x4 before the pooling."""
    net = Sequential(
        Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        BatchNorm2d(64),
        ReLU())
    net.add_module("resnet_block1", resnet_block(64, 64, 2, first_block=True))
    net.add_module("resnet_block2", resnet_block(64, 128, 2))
    net.add_module("resnet_block3", resnet_block(128, 256, 2))
    net.add_module("resnet_block4", resnet_block(256, 512, 2))
    net.add_module("global_avg_pool", AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", Sequential(Flatten(), Linear(512, num_classes)))
    return net


__all__ = ["LENET_SHAPES", "lenet_params", "lenet", "LeNet", "Residual", "resnet_block", "resnet18"]
