"""mgpu's differentiable functional ops, each with its backward (PyTorch's ``torch.nn.functional``).

Shapes: N batch, C in-channels, K out-channels, H/W image, R/S kernel, P/Q output height/width.
Every op runs on its inputs' device (they must share one) and records itself for autograd when
an input requires grad. The forward and backward math lives in C++ (cpp/ops/).
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

from . import amp, autograd
from . import random as _random
from . import trace as _trace
from .engine import core as _core
from .tensor import (
    Tensor,
    argmax,  # noqa: F401  (an op of this module, defined where Tensor calls it)
    check_tensors,
    mm,
    needs_grad,
)

IntPair = Union[int, Tuple[int, int]]


def as_pair(v: IntPair, name: str) -> Tuple[int, int]:
    """An int or a pair as (h, w), each converted with int() (ValueError for a longer sequence)."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
        return int(v[0]), int(v[1])
    return int(v), int(v)


def as_square(v: IntPair, name: str, op: str) -> int:
    """An int or a pair that is the same on both axes, as one int (ValueError otherwise)."""
    a, b = as_pair(v, name)
    if a != b:
        raise ValueError(f"{op}: {name} must be the same on both axes, got {v!r}")
    return a


def conv2d(x: Tensor, w: Tensor, b: Optional[Tensor] = None, stride: IntPair = 1,
           padding: IntPair = 0) -> Tensor:
    """Convolution (cross-correlation): x (N, C, H, W), w (K, C, R, S), b (K,) -> (N, K, P, Q)."""
    check_tensors("conv2d", x=x, w=w, b=b)
    s, p = as_square(stride, "stride", "conv2d"), as_square(padding, "padding", "conv2d")
    prec = amp.get_precision()  # mgpu.autocast's; backward runs with the forward's
    out = Tensor(_core.conv2d_forward(x._t, w._t, b._t if b is not None else None, s, p, prec))

    def backward(dy):
        dx, dw, db = _core.conv2d_backward(x._t, w._t, dy._t, s, p, needs_grad(x), b is not None,
                                           prec)
        wrap = lambda h: Tensor(h) if h is not None else None  # noqa: E731
        return wrap(dx), wrap(dw), wrap(db)

    return autograd.attach(out, [x, w, b], backward)


def avg_pool2d(x: Tensor, kernel_size: IntPair, stride: Optional[IntPair] = None) -> Tensor:
    """Average pooling without padding: x (N, C, H, W) -> (N, C, P, Q), floor output size."""
    check_tensors("avg_pool2d", x=x)
    kh, kw = as_pair(kernel_size, "kernel_size")
    sh, sw = as_pair(stride, "stride") if stride is not None else (kh, kw)
    out = Tensor(_core.avg_pool2d_forward(x._t, kh, kw, sh, sw))
    return autograd.attach(out, [x], lambda dy: (
        Tensor(_core.avg_pool2d_backward(x._t, dy._t, kh, kw, sh, sw)),))


def int_pair(v, name: str, op: str) -> Tuple[int, int]:
    """An int or a pair of ints, as (h, w): a float, a bool or anything else is a TypeError."""
    pair = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    if len(pair) != 2 or any(isinstance(e, bool) or not isinstance(e, numbers.Integral)
                             for e in pair):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {v!r}")
    return int(pair[0]), int(pair[1])


def max_pool2d(x: Tensor, kernel_size: IntPair, stride: Optional[IntPair] = None,
               padding: IntPair = 0, dilation: IntPair = 1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor:
    """Max pooling, PyTorch's ``F.max_pool2d``: x (N, C, H, W) -> (N, C, P, Q) with
    P = (H + 2 * padding - kernel) // stride + 1 (likewise Q); stride defaults to kernel_size;
    padding is implicit -inf and at most half the kernel. Backward sends each dy to where its
    window's maximum sits: the first maximum in row-major window order on ties, the last NaN when
    the window holds NaNs (PyTorch's CPU rule). Only dilation 1, floor output size and no returned
    indices are supported (ValueError otherwise)."""
    check_tensors("max_pool2d", x=x)
    kh, kw = int_pair(kernel_size, "kernel_size", "max_pool2d")
    sh, sw = int_pair(stride, "stride", "max_pool2d") if stride is not None else (kh, kw)
    ph, pw = int_pair(padding, "padding", "max_pool2d")
    if int_pair(dilation, "dilation", "max_pool2d") != (1, 1):
        raise ValueError(f"max_pool2d: only dilation 1 is supported, got {dilation!r}")
    if ceil_mode or return_indices:
        raise ValueError("max_pool2d: ceil_mode=True and return_indices=True are not supported; "
                         "use the default floor output size")
    if x.ndim != 4:
        raise ValueError(f"max_pool2d: x must have 4 dims (N, C, H, W), got shape {x.shape}")
    keep = autograd.is_recording() and x.requires_grad
    y, indices = _core.max_pool2d_forward(x._t, kh, kw, sh, sw, ph, pw, keep)
    H, W = x.shape[2], x.shape[3]
    return autograd.attach(Tensor(y), [x], lambda dy: (Tensor(_core.max_pool2d_backward(
        indices, dy._t, H, W, kh, kw, sh, sw, ph, pw)),), saved=[])


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """PyTorch's ``F.dropout``: in training each element is zeroed with probability ``p`` and the
    rest scaled by 1 / (1 - p); otherwise x itself. The mask is drawn from ``mgpu.random`` (so
    ``mgpu.random.seed`` makes it reproducible) and backward multiplies dy by the same mask."""
    check_tensors("dropout", x=x)
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout: p must be a probability in [0, 1], got {p!r}")
    p = float(p)
    if not training or p == 0.0:
        return x
    if x.dtype.name != "float32":
        raise TypeError(f"dropout: x must be float32, got {x.dtype.name}")
    mask = _random.dropout_mask(x.shape, p, x.device)
    out = Tensor(_core.binary(_core.BinaryOp.Mul, x._t, mask._t))
    return autograd.attach(out, [x], lambda dy: (
        Tensor(_core.binary(_core.BinaryOp.Mul, dy._t, mask._t)),), saved=[])


def relu(x: Tensor) -> Tensor:
    """max(x, 0), elementwise."""
    check_tensors("relu", x=x)
    out = Tensor(_core.relu_forward(x._t))
    return autograd.attach(out, [x], lambda dy: (Tensor(_core.relu_backward(x._t, dy._t)),))


dot = mm  # MXNet's name in the chapter (np.dot on matrices)


def cross_entropy(y_hat: Tensor, y: Tensor) -> Tensor:
    """Softmax cross-entropy per example (reduction none): y_hat (N, M) logits, y (N,) -> (N,)."""
    check_tensors("cross_entropy", y_hat=y_hat, y=y)
    out = Tensor(_core.softmax_ce_forward(y_hat._t, y._t))
    return autograd.attach(out, [y_hat], lambda dy: (
        Tensor(_core.softmax_ce_backward(y_hat._t, y._t, dy._t)),))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x W^T + b (PyTorch's layout): x (N, I), weight (O, I), bias (O,) -> (N, O)."""
    check_tensors("linear", x=x, weight=weight, bias=bias)
    prec = amp.get_precision()  # mgpu.autocast's; backward runs with the forward's
    out = Tensor(_core.mm(x._t, weight._t, False, True, prec))
    if bias is not None:
        out = Tensor(_core.binary(_core.BinaryOp.Add, out._t, bias._t))

    def backward(dy):
        dx = Tensor(_core.mm(dy._t, weight._t, False, False, prec)) if needs_grad(x) else None
        dw = Tensor(_core.mm(dy._t, x._t, True, False, prec)) if needs_grad(weight) else None
        db = None
        if needs_grad(bias):
            # bf16: the sum of dy rounded to bfloat16, the dy the products see (conv2d's db too).
            g = _core.bf16_round(dy._t) if prec == "bf16" else dy._t
            db = Tensor(_core.sum_to_shape(g, list(bias.shape)))
        return dx, dw, db

    return autograd.attach(out, [x, weight, bias], backward)


# --- batch normalisation (sec. 12.6) ------------------------------------------------------------

_Op = _core.BinaryOp


def _check_channel_tensor(name: str, t, x: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"batch_norm: {name} must be an mgpu Tensor or None, "
                        f"got {type(t).__name__}")
    C = x.shape[1]
    if t.shape != (C,):
        raise ValueError(f"batch_norm: {name} must have shape ({C},) (one value per channel of x, "
                         f"shape {x.shape}), got shape {t.shape}")
    if t.device != x.device:
        raise ValueError(f"batch_norm: {name} is on {t.device} but x is on {x.device}; move it "
                         f"with .to({x.device})")
    if t.dtype.name != "float32":
        raise TypeError(f"batch_norm: {name} must be float32, got {t.dtype.name}")


def batch_norm(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Batch normalisation over N, H, W per channel: x (N, C, H, W) or (N, C) -> same shape.

    ``training``: normalises with the batch's mean and biased variance, and (when given) updates
    ``running_mean <- (1 - momentum) * running_mean + momentum * mean`` and ``running_var`` likewise
    with the unbiased variance, in place and unrecorded. Otherwise normalises with the running
    statistics. ``weight`` (gamma) and ``bias`` (beta), shape (C,), may be None. Differentiable
    w.r.t. x, weight and bias.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"batch_norm: x must be an mgpu Tensor, got {type(x).__name__}")
    if x.ndim not in (2, 4):
        raise ValueError(f"batch_norm: x must have 4 dims (N, C, H, W) or 2 dims (N, C), got "
                         f"shape {x.shape}")
    for name, t in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        _check_channel_tensor(name, t, x)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"batch_norm: momentum must be a number, got {type(momentum).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"batch_norm: eps must be a number, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"batch_norm: eps must be > 0, got {eps}")
    training = bool(training)
    count = x.size // x.shape[1] if x.shape[1] else 0
    if training:
        if count <= 1:
            raise ValueError(f"batch_norm: Expected more than 1 value per channel when training, "
                             f"got input of shape {x.shape}")
        mean, var = _core.batch_norm_stats(x._t)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: running_mean and running_var are needed when "
                             "training=False (evaluation normalises with them)")
        mean, var = running_mean._t, running_var._t
    gamma = weight._t if weight is not None else None
    beta = bias._t if bias is not None else None
    out = Tensor(_core.batch_norm_forward(x._t, mean, var, gamma, beta, float(eps)))
    if training:
        _update_running(running_mean, mean, momentum, 1.0)
        _update_running(running_var, var, momentum, count / (count - 1))

    def backward(dy):
        need_x = x.requires_grad
        need_w = weight is not None and weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        sum_dy, sum_dy_xhat = _core.batch_norm_backward_reduce(x._t, dy._t, mean, var, float(eps))
        dx = Tensor(_core.batch_norm_backward(x._t, dy._t, mean, var, gamma, sum_dy, sum_dy_xhat,
                                              float(count), float(eps), training)) \
            if need_x else None
        return (dx, Tensor(sum_dy_xhat) if need_w else None, Tensor(sum_dy) if need_b else None)

    return autograd.attach(out, [x, weight, bias], backward)


def gather_rows(parts: Sequence[Tensor], device) -> Tensor:
    """Concatenates tensors from any devices along axis 0 into one on ``device`` (DataParallel's
    gather); backward sends each part its rows of the gradient, on its own device."""
    from .device import as_device
    parts = list(parts)
    check_tensors("gather_rows", **{f"parts[{i}]": p for i, p in enumerate(parts)})
    if not parts:
        raise ValueError("gather_rows: nothing to gather; pass at least one tensor")
    rest = parts[0].shape[1:]
    for i, p in enumerate(parts):
        if p.ndim == 0 or p.shape[1:] != rest or p.dtype != parts[0].dtype:
            raise ValueError(f"gather_rows: parts[{i}] has shape {p.shape} ({p.dtype}); every "
                             f"part must be (rows, {', '.join(map(str, rest))}) "
                             f"{parts[0].dtype}")
    device = as_device(device)
    rows = [p.shape[0] for p in parts]
    out = Tensor(_core.Tensor.empty([sum(rows)] + list(rest), parts[0].dtype.name, device))
    begin = 0
    for p, n in zip(parts, rows):
        _core.copy(out._t.slice_rows(begin, begin + n), p._t)
        begin += n

    def backward(dy):
        grads, b = [], 0
        for p, n in zip(parts, rows):
            grads.append(Tensor(_core.to_device(dy._t.slice_rows(b, b + n), p.device, True)))
            b += n
        return tuple(grads)

    return autograd.attach(out, parts, backward)


def _update_running(running: Optional[Tensor], batch: "_core.Tensor", momentum: float,
                    scale: float) -> None:
    """running <- (1 - momentum) * running + momentum * scale * batch, in place (not recorded)."""
    if running is None:
        return
    _core.batch_norm_update_running(running._t, batch, float(1.0 - momentum),
                                    float(momentum * scale))
    running._t.bump_version()


# Each public op is a host span on the timeline (mgpu.profile); one flag check while it is off.
for _name in ("conv2d", "avg_pool2d", "max_pool2d", "dropout", "relu", "mm", "dot",
              "cross_entropy", "argmax", "linear", "batch_norm", "gather_rows"):
    if _name in globals():
        globals()[_name] = _trace.span(_name)(globals()[_name])
del _name
