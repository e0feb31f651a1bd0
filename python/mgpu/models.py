"""The chapters' networks: 12.5's LeNet written op by op (``lenet``, ``lenet_params``) and, for
12.6, networks made of ``mgpu.nn`` modules.

Shapes: X (N, 1, 28, 28) Fashion-MNIST images -> logits (N, 10).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .ops import avg_pool2d, conv2d, mm, relu
from .random import normal
from .tensor import Tensor, zeros

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
