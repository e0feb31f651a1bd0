"""``mgpu.nn.utils``: gradient clipping by global norm (PyTorch's ``torch.nn.utils``).

``clip_grad_norm_(net.parameters(), max_norm)`` between ``loss.backward()`` and
``trainer.step()``: the norm is taken over every gradient together, wherever it lives (the
parameters may sit on several devices; under ``nn.DataParallel`` they are the master's, which
hold the replicas' summed gradients; under mpirun the gradients are reduced first, so every rank
computes the same norm), and every gradient is scaled by min(1, max_norm / (norm + 1e-6)).
The fused step (``DataParallel.train_step(..., clip_grad_norm=max_norm)``) applies the same rule
to its summed gradients before its update.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, List, Union

import numpy as np

from .autograd import no_grad
from .tensor import Tensor, array

__all__ = ["clip_grad_norm_", "get_total_norm"]


def _grads(parameters, where: str) -> List[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    if isinstance(parameters, (str, bytes, dict)) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"{where}: parameters must be a tensor or an iterable of tensors (e.g. "
                        f"net.parameters()), got {type(parameters).__name__}")
    grads = []
    for i, p in enumerate(parameters):
        if not isinstance(p, Tensor):
            raise TypeError(f"{where}: parameters[{i}] is a {type(p).__name__}, expected an "
                            "mgpu tensor")
        if p.grad is not None:
            grads.append(p.grad)
    return grads


def _norm_type(norm_type, where: str) -> float:
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) \
            or not norm_type > 0:
        raise ValueError(f"{where}: norm_type must be a number > 0 or math.inf, got "
                         f"{norm_type!r}")
    return float(norm_type)


def get_total_norm(tensors: Iterable[Tensor], norm_type: float = 2.0) -> float:
    """The norm of all ``tensors`` taken together, as a Python float (accumulated in float64):
    for the 2-norm each tensor's sum of squares is formed on its own device and only the sums
    come to the host."""
    p = _norm_type(norm_type, "get_total_norm")
    tensors = list(tensors)
    if not tensors:
        return 0.0
    if p == 2.0:
        with no_grad():
            squares = [(t * t).sum() for t in tensors]  # enqueued on every device first
        return math.sqrt(sum(float(s.item()) for s in squares))
    hosts = [np.abs(t.numpy().astype(np.float64)) for t in tensors]
    if p == math.inf:
        return max(float(h.max()) if h.size else 0.0 for h in hosts)
    return float(sum(float(np.sum(h ** p)) for h in hosts) ** (1.0 / p))


def check_max_norm(max_norm, where: str, name: str = "max_norm") -> float:
    """The rule for a gradient-clipping norm, for every entry that takes one
    (``clip_grad_norm_``, ``DataParallel.train_step``'s and ``train_concise``'s
    ``clip_grad_norm``, ``FusedModel.train_step``'s ``max_norm``): ``max_norm`` as a float;
    ValueError, naming ``where`` and ``name``, unless it is a finite number >= 0. The steps
    below an entry trust the value it returns."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) \
            or not math.isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0 (the largest global "
                         f"norm of the gradients), got {max_norm!r}")
    return float(max_norm)


def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Scales the gradients of ``parameters`` in place so that their global ``norm_type`` norm
    is at most ``max_norm`` (scale = max_norm / (norm + 1e-6), clamped at 1, as PyTorch's).
    Returns the norm before clipping, a 0-d float32 tensor on the first gradient's device
    (0 on cpu(0) when no parameter has a gradient). ``error_if_nonfinite``: raise RuntimeError
    instead of scaling when the norm is NaN or infinite (nothing changes)."""
    where = "clip_grad_norm_"
    return clip_grads(parameters, check_max_norm(max_norm, where), _norm_type(norm_type, where),
                      error_if_nonfinite, where)


def clip_grads(parameters, max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, where: str = "clip_grad_norm_") -> Tensor:
    """:func:`clip_grad_norm_` with ``max_norm`` and ``norm_type`` checked already (by
    :func:`check_max_norm` where the user gave them): a loop that checked its clipping norm
    once calls this at every step."""
    grads = _grads(parameters, where)
    if not grads:
        return array(np.float32(0.0))
    total = get_total_norm(grads, norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"{where}: the total norm of order {norm_type} of the gradients is "
                           f"{total}, so they cannot be clipped; pass error_if_nonfinite=False "
                           "to scale them anyway")
    coef = min(max_norm / (total + 1e-6), 1.0)
    with no_grad():
        for g in grads:
            g *= coef
    return array(np.float32(total), device=grads[0].device)
