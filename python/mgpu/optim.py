"""Optimizers for ``mgpu.nn`` modules (PyTorch's ``torch.optim``), used by the concise chapter
(sec. 12.6): ``trainer = mgpu.optim.SGD(net.parameters(), lr)``; ``trainer.step()``.

SGD follows PyTorch's update exactly: g = grad + weight_decay * p; with momentum,
b = g on the first step, else b = momentum * b + (1 - dampening) * g, and g = g + momentum * b
(Nesterov) or g = b; then p = p - lr * g.
"""
from __future__ import annotations

import numbers
from typing import Dict, Iterable, List, Optional

from .autograd import no_grad
from .tensor import Tensor


def _number(v, name: str, minimum: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"SGD: {name} must be a number, got {type(v).__name__}")
    if not v >= minimum:
        raise ValueError(f"SGD: {name} must be >= {minimum}, got {v}")
    return float(v)


class SGD:
    """Stochastic gradient descent with optional momentum, dampening, weight decay, Nesterov.

    ``params`` is an iterable of parameters (``net.parameters()``); every one must require grad.
    ``step()`` updates the parameters that have a gradient in place; ``zero_grad()`` clears them.
    """

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if isinstance(params, Tensor):
            raise TypeError("SGD: params must be an iterable of tensors (e.g. net.parameters()), "
                            "got a single tensor; wrap it in a list")
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise ValueError("SGD: got an empty parameter list; pass net.parameters() of a "
                             "network that has parameters")
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"SGD: params[{i}] is a {type(p).__name__}, expected an mgpu "
                                "tensor (a module's parameter)")
            if not p.requires_grad:
                raise ValueError(f"SGD: params[{i}] (shape {p.shape}) does not require grad; "
                                 "only trainable tensors can be optimized")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("SGD: a parameter appears more than once in params")
        self.lr = _number(lr, "lr")
        self.momentum = _number(momentum, "momentum")
        self.dampening = _number(dampening, "dampening")
        self.weight_decay = _number(weight_decay, "weight_decay")
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov momentum needs momentum > 0 and dampening = 0")
        # One momentum buffer per parameter (by position), created at its first step.
        self._buffers: Dict[int, Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (to None, PyTorch's default, or to zeros)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def _checked_grads(self) -> List[Optional[Tensor]]:
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            raise ValueError(
                f"SGD.step: none of the optimizer's {len(self.params)} parameters has a gradient. "
                "Run loss.backward() first, through a network built from these parameters (an "
                "optimizer made from another network's parameters, e.g. before re-creating the "
                "network, sees no gradients)")
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(f"SGD.step: params[{i}] has shape {p.shape} on {p.device} but "
                                 f"its gradient has shape {g.shape} on {g.device}")
        return grads

    def step(self) -> None:
        """Updates every parameter that has a gradient, in place (not recorded by autograd)."""
        grads = self._checked_grads()
        lr, mom, wd = self.lr, self.momentum, self.weight_decay
        with no_grad():
            for i, (p, g) in enumerate(zip(self.params, grads)):
                if g is None:
                    continue
                if wd != 0:
                    g = g + p.detach() * wd
                if mom != 0:
                    buf = self._buffers.get(i)
                    if buf is None or buf.device != p.device:
                        buf = g.copyto(p.device)
                        self._buffers[i] = buf
                    else:
                        buf *= mom
                        buf += g * (1.0 - self.dampening) if self.dampening else g
                    g = g + buf * mom if self.nesterov else buf
                p -= g * lr

    def state_dict(self) -> dict:
        """Hyperparameters and momentum buffers (by parameter position), as PyTorch's."""
        return {"state": {i: {"momentum_buffer": b.detach()} for i, b in self._buffers.items()},
                "param_groups": [{"lr": self.lr, "momentum": self.momentum,
                                  "dampening": self.dampening, "weight_decay": self.weight_decay,
                                  "nesterov": self.nesterov,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyperparameters and momentum buffers saved by :meth:`state_dict`."""
        try:
            group = state_dict["param_groups"][0]
            state = state_dict["state"]
        except (KeyError, IndexError, TypeError):
            raise ValueError("SGD.load_state_dict: expected a dict from SGD.state_dict() with "
                             "'state' and 'param_groups'") from None
        if len(group.get("params", [])) != len(self.params):
            raise ValueError(f"SGD.load_state_dict: the saved state is for "
                             f"{len(group.get('params', []))} parameters, this optimizer has "
                             f"{len(self.params)}")
        buffers = {}
        for i, entry in state.items():
            b = entry["momentum_buffer"]
            if not 0 <= int(i) < len(self.params) or b.shape != self.params[int(i)].shape:
                raise ValueError(f"SGD.load_state_dict: momentum buffer {i} does not match the "
                                 "parameter at that position")
            buffers[int(i)] = b.copyto(self.params[int(i)].device)
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            setattr(self, name, _number(group[name], name))
        self.nesterov = bool(group["nesterov"])
        self._buffers = buffers

    def __repr__(self) -> str:
        return (f"SGD(lr={self.lr}, momentum={self.momentum}, dampening={self.dampening}, "
                f"weight_decay={self.weight_decay}, nesterov={self.nesterov})")


__all__ = ["SGD"]
