"""mgpu's differentiable functional ops, each with its backward (PyTorch's ``torch.nn.functional``).

Shapes: N batch, C in-channels, K out-channels, H/W image, R/S kernel, P/Q output height/width.
Every op runs on its inputs' device (they must share one) and records itself for autograd when
an input requires grad. The forward and backward math lives in C++ (cpp/ops/).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

from . import _core
from . import autograd
from .tensor import Tensor

IntPair = Union[int, Tuple[int, int]]


def _pair(v: IntPair, name: str) -> Tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
        return int(v[0]), int(v[1])
    return int(v), int(v)


def _square(v: IntPair, name: str, op: str) -> int:
    a, b = _pair(v, name)
    if a != b:
        raise ValueError(f"{op}: {name} must be the same on both axes, got {v!r}")
    return a


def _need(t: Optional[Tensor]) -> bool:
    return t is not None and t.requires_grad


def conv2d(x: Tensor, w: Tensor, b: Optional[Tensor] = None, stride: IntPair = 1,
           padding: IntPair = 0) -> Tensor:
    """2-D convolution (cross-correlation): x (N, C, H, W), w (K, C, R, S), b (K,) -> (N, K, P, Q)."""
    s, p = _square(stride, "stride", "conv2d"), _square(padding, "padding", "conv2d")
    out = Tensor(_core.conv2d_forward(x._t, w._t, b._t if b is not None else None, s, p))

    def backward(dy):
        dx, dw, db = _core.conv2d_backward(x._t, w._t, dy._t, s, p, _need(x), b is not None)
        wrap = lambda h: Tensor(h) if h is not None else None  # noqa: E731
        return wrap(dx), wrap(dw), wrap(db)

    return autograd.attach(out, [x, w, b], backward)


def avg_pool2d(x: Tensor, kernel_size: IntPair, stride: Optional[IntPair] = None) -> Tensor:
    """Average pooling without padding: x (N, C, H, W) -> (N, C, P, Q), floor output size."""
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride, "stride") if stride is not None else (kh, kw)
    out = Tensor(_core.avg_pool2d_forward(x._t, kh, kw, sh, sw))
    return autograd.attach(out, [x], lambda dy: (
        Tensor(_core.avg_pool2d_backward(x._t, dy._t, kh, kw, sh, sw)),))


def relu(x: Tensor) -> Tensor:
    """max(x, 0), elementwise."""
    out = Tensor(_core.relu_forward(x._t))
    return autograd.attach(out, [x], lambda dy: (Tensor(_core.relu_backward(x._t, dy._t)),))


def mm(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product: a (M, K) @ b (K, N) -> (M, N)."""
    out = Tensor(_core.mm(a._t, b._t))

    def backward(dy):
        da = Tensor(_core.mm(dy._t, b._t, False, True)) if _need(a) else None
        db = Tensor(_core.mm(a._t, dy._t, True, False)) if _need(b) else None
        return da, db

    return autograd.attach(out, [a, b], backward)


dot = mm  # MXNet's name in the chapter (np.dot on matrices)


def cross_entropy(y_hat: Tensor, y: Tensor) -> Tensor:
    """Softmax cross-entropy per example (reduction none): y_hat (N, M) logits, y (N,) -> (N,)."""
    out = Tensor(_core.softmax_ce_forward(y_hat._t, y._t))
    return autograd.attach(out, [y_hat], lambda dy: (
        Tensor(_core.softmax_ce_backward(y_hat._t, y._t, dy._t)),))


def argmax(x: Tensor, axis: int = -1) -> Tensor:
    """Index of the largest entry along ``axis`` (the last axis of a 1-d or 2-d tensor)."""
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"argmax: only the last axis is supported (axis=-1 or {x.ndim - 1}), "
                         f"got axis={axis}")
    return Tensor(_core.argmax(x._t))


