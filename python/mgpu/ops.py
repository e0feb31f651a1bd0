"""Differentiable functional ops of the concise chapter (d2l 12.6), PyTorch's ``F.*`` semantics.

Shapes: N batch, C channels, H/W image. The math lives in C++ (cpp/ops/); each op records itself
for autograd when an input requires grad.
"""
from __future__ import annotations

from typing import Optional

from . import _core
from . import autograd
from .tensor import Tensor

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


def _update_running(running: Optional[Tensor], batch: "_core.Tensor", momentum: float,
                    scale: float) -> None:
    """running <- (1 - momentum) * running + momentum * scale * batch, in place (not recorded)."""
    if running is None:
        return
    _core.binary_scalar_inplace(_Op.Mul, running._t, float(1.0 - momentum))
    step = _core.binary_scalar(_Op.Mul, batch, float(momentum * scale), False)
    _core.binary_inplace(_Op.Add, running._t, step)
