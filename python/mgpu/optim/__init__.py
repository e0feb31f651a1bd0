"""Optimizers for ``mgpu.nn`` modules (PyTorch's ``torch.optim``), used by the concise chapter
(sec. 12.6): ``trainer = mgpu.optim.SGD(net.parameters(), lr)``; ``trainer.step()``.

SGD follows PyTorch's update exactly: g = grad + weight_decay * p; with momentum,
b = g on the first step, else b = momentum * b + (1 - dampening) * g, and g = g + momentum * b
(Nesterov) or g = b; then p = p - lr * g.
"""
from __future__ import annotations

import numbers
from typing import Dict, Iterable, List, Optional

import numpy as np

from .autograd import no_grad
from .tensor import Tensor, array


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

    def _momentum_list(self) -> List[Optional[Tensor]]:
        """The momentum buffer of every parameter, by position (None where there is none)."""
        return [self._buffers.get(i) for i in range(len(self.params))]

    def _set_momentum_list(self, buffers: List[Optional[Tensor]]) -> None:
        self._buffers = {i: b for i, b in enumerate(buffers) if b is not None}

    def state_dict(self) -> dict:
        """Hyperparameters and momentum buffers (by parameter position), as PyTorch's."""
        return {"state": {i: {"momentum_buffer": b.detach()} for i, b in self._buffers.items()},
                "param_groups": [{"lr": self.lr, "momentum": self.momentum,
                                  "dampening": self.dampening, "weight_decay": self.weight_decay,
                                  "nesterov": self.nesterov,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyperparameters and momentum buffers saved by :meth:`state_dict` (PyTorch's
        layout; extra keys such as PyTorch's ``maximize`` or ``foreach`` are ignored). Buffers
        are copied to their parameters' devices. Everything is checked before anything changes:
        a missing or misshaped entry raises and leaves the optimizer as it was."""
        where = "SGD.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict from SGD.state_dict(), got "
                            f"{type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"{where}: the dict has no '{key}'; expected SGD.state_dict()'s "
                                 "'state' and 'param_groups'")
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, (list, tuple)) or len(groups) != 1 \
                or not isinstance(groups[0], dict):
            raise ValueError(f"{where}: 'param_groups' must be a list of one group (a dict), as "
                             "this optimizer has one")
        group = groups[0]
        for key in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "params"):
            if key not in group:
                raise ValueError(f"{where}: the parameter group has no '{key}'")
        n = len(self.params)
        if not isinstance(group["params"], (list, tuple)) or len(group["params"]) != n:
            got = len(group["params"]) if isinstance(group["params"], (list, tuple)) else "?"
            raise ValueError(f"{where}: the saved state is for {got} parameters, this optimizer "
                             f"has {n}")
        hyper = {name: _number(group[name], name) for name in
                 ("lr", "momentum", "dampening", "weight_decay")}
        nesterov = group["nesterov"]
        if not isinstance(nesterov, (bool, int)):
            raise TypeError(f"{where}: nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
            raise ValueError(f"{where}: nesterov momentum needs momentum > 0 and dampening = 0")
        if not isinstance(state, dict):
            raise TypeError(f"{where}: 'state' must be a dict {{position: {{'momentum_buffer': "
                            f"tensor}}}}, got {type(state).__name__}")
        checked = {}
        for i, entry in state.items():
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
                raise ValueError(f"{where}: state key {i!r} is not a parameter position in "
                                 f"[0, {n})")
            if not isinstance(entry, dict) or "momentum_buffer" not in entry:
                raise ValueError(f"{where}: state[{i}] must be a dict with a 'momentum_buffer'")
            b = entry["momentum_buffer"]
            if b is None:
                continue
            if isinstance(b, np.ndarray):
                b = array(b.astype(np.float32, copy=False), device=self.params[int(i)].device)
            if not isinstance(b, Tensor):
                raise TypeError(f"{where}: state[{i}]['momentum_buffer'] is "
                                f"{type(b).__name__}, expected an mgpu tensor or NumPy array")
            p = self.params[int(i)]
            if b.shape != p.shape:
                raise ValueError(f"{where}: the momentum buffer of parameter {i} has shape "
                                 f"{b.shape}, the parameter has shape {p.shape}")
            if b.dtype != p.dtype:
                raise ValueError(f"{where}: the momentum buffer of parameter {i} is {b.dtype}, "
                                 f"the parameter is {p.dtype}")
            checked[int(i)] = b
        buffers = {i: b.copyto(self.params[i].device) for i, b in checked.items()}
        for name, v in hyper.items():
            setattr(self, name, v)
        self.nesterov = bool(nesterov)
        self._buffers = buffers

    def __repr__(self) -> str:
        return (f"SGD(lr={self.lr}, momentum={self.momentum}, dampening={self.dampening}, "
                f"weight_decay={self.weight_decay}, nesterov={self.nesterov})")


__all__ = ["SGD"]
