"""SGD, Adam and AdamW on one Optimizer base with parameter groups (the rules: the package's
docstring, ``help(mgpu.optim)``)."""
from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..autograd import no_grad, zero_grads
from ..engine import core as _core
from ..tensor import Tensor, array, check_nonnegative, zeros_like


def check_betas(v, where: str) -> Tuple[float, float]:
    """Adam's ``betas`` as a pair of floats; TypeError unless a pair, ValueError unless each
    is a finite number in [0, 1). The rule for every entry that takes betas (the optimizers'
    groups, ``FusedModel.train_step``)."""
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {v!r}")
    b = tuple(check_nonnegative(x, where, f"betas[{i}]") for i, x in enumerate(v))
    for i, x in enumerate(b):
        if not x < 1.0:
            raise ValueError(f"{where}: betas[{i}] must lie in [0, 1), got {x}")
    return b  # type: ignore[return-value]


def _group_hyperparameter(key: str) -> property:
    """An optimizer attribute for hyperparameter ``key``: reads the first group's value, and a
    value set is checked and set in every group (as ``trainer.lr = 0.1`` is used)."""
    return property(lambda self: self.param_groups[0][key],
                    lambda self, value: self._set_everywhere(key, value),
                    doc=f"The first group's {key}; setting it sets every group's.")


class Optimizer:
    """What every optimizer shares: parameter groups, ``zero_grad``, and PyTorch's
    ``state_dict`` layout. ``state`` maps a parameter's position (over all groups, in order) to
    its state dict (e.g. ``{'momentum_buffer': t}``)."""

    #: Hyperparameters every group holds, in the order of the constructor's arguments.
    _hyper: Tuple[str, ...] = ()

    def __init__(self, params, defaults: Dict[str, Any]):
        name = type(self).__name__
        if isinstance(params, Tensor):
            raise TypeError(f"{name}: params must be an iterable of tensors (e.g. "
                            "net.parameters()), got a single tensor; wrap it in a list")
        if isinstance(params, dict):
            raise TypeError(f"{name}: params must be an iterable of tensors or of parameter "
                            "groups (dicts); wrap a single group in a list")
        self.defaults = dict(defaults)
        self.param_groups: List[Dict[str, Any]] = []
        self.state: Dict[int, Dict[str, Any]] = {}
        items = list(params)
        if not items:
            raise ValueError(f"{name}: got an empty parameter list; pass net.parameters() of a "
                             "network that has parameters")
        groups = items if all(isinstance(g, dict) for g in items) else [{"params": items}]
        if any(isinstance(g, dict) for g in items) and not all(isinstance(g, dict)
                                                               for g in items):
            raise TypeError(f"{name}: params mixes tensors and parameter groups (dicts); pass "
                            "either only tensors or only groups")
        for g in groups:
            self.add_param_group(g)

    # --- parameter groups -----------------------------------------------------------------

    @property
    def params(self) -> List[Tensor]:
        """Every parameter, group after group (the positions ``state`` is keyed by)."""
        return [p for g in self.param_groups for p in g["params"]]

    def _check_group(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The group's hyperparameters checked (and converted); raises before anything changes."""
        raise NotImplementedError

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (a dict with ``'params'``; missing hyperparameters take the defaults)."""
        name = type(self).__name__
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"{name}: a parameter group must be a dict with 'params', got "
                            f"{type(param_group).__name__}")
        ps = param_group["params"]
        if isinstance(ps, Tensor):
            ps = [ps]
        ps = list(ps)
        if not ps:
            raise ValueError(f"{name}: got an empty parameter list; pass net.parameters() of a "
                             "network that has parameters")
        at = len(self.params)
        for i, p in enumerate(ps):
            if not isinstance(p, Tensor):
                raise TypeError(f"{name}: params[{at + i}] is a {type(p).__name__}, expected an "
                                "mgpu tensor (a module's parameter)")
            if not p.requires_grad:
                raise ValueError(f"{name}: params[{at + i}] (shape {p.shape}) does not require "
                                 "grad; only trainable tensors can be optimized")
        seen = {id(p) for p in self.params}
        if len({id(p) for p in ps}) != len(ps) or any(id(p) in seen for p in ps):
            raise ValueError(f"{name}: a parameter appears more than once in params (or in two "
                             "parameter groups)")
        group = dict(self.defaults)
        group.update({k: v for k, v in param_group.items() if k != "params"})
        group = self._check_group(group, name)
        group["params"] = ps
        self.param_groups.append(group)

    def _set_everywhere(self, key: str, value) -> None:
        checked = [self._check_group(dict(g, **{key: value}), type(self).__name__)
                   for g in self.param_groups]
        for g, c in zip(self.param_groups, checked):
            g[key] = c[key]

    def current_groups(self, where: str) -> List[Dict[str, Any]]:
        """Every parameter group as a step reads it now, its hyperparameters checked (and
        converted) with the constructor's rules; raises ValueError or TypeError naming the group
        before anything changes. A step calls it once: the values a scheduler or the user wrote
        into ``param_groups`` (``trainer.param_groups[0]['lr'] = x``) pass no setter, so this is
        where they are checked; the kernels below trust them."""
        return [self._check_group(g, f"{where}: param_groups[{i}]")
                for i, g in enumerate(self.param_groups)]

    lr = _group_hyperparameter("lr")
    weight_decay = _group_hyperparameter("weight_decay")

    # --- gradients ------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (to None, PyTorch's default, or to zeros)."""
        zero_grads(self.params, set_to_none)

    def _checked_grads(self) -> List[Optional[Tensor]]:
        name = type(self).__name__
        params = self.params
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            raise ValueError(
                f"{name}.step: none of the optimizer's {len(params)} parameters has a gradient. "
                "Run loss.backward() first, through a network built from these parameters (an "
                "optimizer made from another network's parameters, e.g. before re-creating the "
                "network, sees no gradients)")
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(f"{name}.step: params[{i}] has shape {p.shape} on {p.device} "
                                 f"but its gradient has shape {g.shape} on {g.device}")
        return grads

    def _positions(self):
        """(position, group, parameter) for every parameter, each group's hyperparameters as
        :meth:`current_groups` checked them for this step."""
        i = 0
        for g in self.current_groups(f"{type(self).__name__}.step"):
            for p in g["params"]:
                yield i, g, p
                i += 1

    def _updates(self):
        """(position, group, parameter, gradient) for every parameter that has a gradient: the
        gradients checked first, then each group as :meth:`_positions` gives it."""
        grads = self._checked_grads()
        for i, group, p in self._positions():
            if grads[i] is not None:
                yield i, group, p, grads[i]

    # --- state ----------------------------------------------------------------------------

    #: The tensors a parameter's state may hold, and whether each must be there.
    _state_tensors: Tuple[Tuple[str, bool], ...] = ()

    def _state_entry(self, entry: Dict[str, Any]) -> Dict[str, Any]:
        return {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in entry.items()}

    def state_dict(self) -> dict:
        """Hyperparameters (one dict per group, ``'params'`` as positions) and per-parameter
        state by position, as PyTorch's."""
        groups, at = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(at, at + n))))
            at += n
        return {"state": {i: self._state_entry(e) for i, e in sorted(self.state.items())},
                "param_groups": groups}

    def _check_state_entry(self, i: int, entry, p: Tensor, where: str) -> Dict[str, Any]:
        """One parameter's saved state, checked and copied to its device."""
        out: Dict[str, Any] = {}
        for key, required in self._state_tensors:
            if key not in entry or entry[key] is None:
                if required:
                    raise ValueError(f"{where}: state[{i}] must be a dict with a '{key}'")
                continue
            b = entry[key]
            if isinstance(b, np.ndarray):
                b = array(b.astype(np.float32, copy=False), device=p.device)
            if not isinstance(b, Tensor):
                raise TypeError(f"{where}: state[{i}]['{key}'] is {type(b).__name__}, expected "
                                "an mgpu tensor or NumPy array")
            if b.shape != p.shape:
                raise ValueError(f"{where}: the {key} of parameter {i} has shape {b.shape}, the "
                                 f"parameter has shape {p.shape}")
            if b.dtype != p.dtype:
                raise ValueError(f"{where}: the {key} of parameter {i} is {b.dtype}, the "
                                 f"parameter is {p.dtype}")
            out[key] = b
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyperparameters and state saved by :meth:`state_dict` (PyTorch's layout;
        extra keys such as PyTorch's ``maximize`` or ``foreach`` are kept but unused, and a
        scheduler's ``initial_lr`` comes back). State tensors are copied to their parameters'
        devices. Everything is checked before anything changes: a missing or misshaped entry
        raises and leaves the optimizer as it was."""
        name = type(self).__name__
        where = f"{name}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict from {name}.state_dict(), got "
                            f"{type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"{where}: the dict has no '{key}'; expected {name}.state_dict()"
                                 "'s 'state' and 'param_groups'")
        groups, state = state_dict["param_groups"], state_dict["state"]
        mine = self.param_groups
        if not isinstance(groups, (list, tuple)) or len(groups) != len(mine) \
                or not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"{where}: 'param_groups' must be a list of {len(mine)} group(s) "
                             "(dicts), as this optimizer has")
        new_groups = []
        for gi, (saved, g) in enumerate(zip(groups, mine)):
            for key in self._hyper + ("params",):
                if key not in saved:
                    raise ValueError(f"{where}: the parameter group {gi} has no '{key}'")
            n = len(g["params"])
            sp = saved["params"]
            if not isinstance(sp, (list, tuple)) or len(sp) != n:
                got = len(sp) if isinstance(sp, (list, tuple)) else "?"
                raise ValueError(f"{where}: the saved state of group {gi} is for {got} "
                                 f"parameters, this optimizer's group has {n}")
            checked = self._check_group({k: v for k, v in saved.items() if k != "params"},
                                        where)
            checked["params"] = g["params"]
            new_groups.append(checked)
        if not isinstance(state, dict):
            raise TypeError(f"{where}: 'state' must be a dict {{position: {{name: tensor}}}}, "
                            f"got {type(state).__name__}")
        params = self.params
        n = len(params)
        checked_state: Dict[int, Dict[str, Any]] = {}
        for i, entry in state.items():
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
                raise ValueError(f"{where}: state key {i!r} is not a parameter position in "
                                 f"[0, {n})")
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: state[{i}] must be a dict")
            checked_state[int(i)] = self._check_state_entry(int(i), entry, params[int(i)], where)
        state_copies = {}
        for i, entry in checked_state.items():
            dev = params[i].device
            state_copies[i] = {k: (v.copyto(dev) if isinstance(v, Tensor) else v)
                               for k, v in entry.items()}
        self.param_groups = new_groups
        self.state = {i: e for i, e in state_copies.items() if e}

    def __repr__(self) -> str:
        hypers = [", ".join(f"{k}={g[k]}" for k in self._hyper) for g in self.param_groups]
        if len(hypers) == 1:
            return f"{type(self).__name__}({hypers[0]})"
        parts = [f"group {i} ({len(g['params'])} params): {h}"
                 for i, (g, h) in enumerate(zip(self.param_groups, hypers))]
        return f"{type(self).__name__}({'; '.join(parts)})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, weight decay, Nesterov.

    ``params`` is an iterable of parameters (``net.parameters()``), every one requiring grad,
    or of parameter groups (dicts with ``'params'`` and any of the hyperparameters below).
    ``step()`` updates the parameters that have a gradient in place; ``zero_grad()`` clears them.
    The update of one parameter is one fused op (``_core.sgd_step``), the rule the fused
    data-parallel step and the chapter's ``sgd`` apply.
    """

    _hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    _state_tensors = (("momentum_buffer", True),)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov})

    def _check_group(self, group, where):
        out = dict(group)
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            out[name] = check_nonnegative(group[name], where, name)
        nesterov = group["nesterov"]
        if not isinstance(nesterov, (bool, int, np.bool_)):
            raise TypeError(f"{where}: nesterov must be a bool, got {type(nesterov).__name__}")
        out["nesterov"] = bool(nesterov)
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise ValueError(f"{where}: nesterov momentum needs momentum > 0 and dampening = 0")
        return out

    # The hyperparameters as attributes (the first group's; setting one sets every group's).
    momentum = _group_hyperparameter("momentum")
    dampening = _group_hyperparameter("dampening")
    nesterov = _group_hyperparameter("nesterov")

    @property
    def _buffers(self) -> Dict[int, Tensor]:
        """The momentum buffers by parameter position."""
        return {i: e["momentum_buffer"] for i, e in self.state.items()
                if e.get("momentum_buffer") is not None}

    def step(self) -> None:
        """Updates every parameter that has a gradient, in place (not recorded by autograd)."""
        with no_grad():
            for i, group, p, g in self._updates():
                mom = group["momentum"]
                buf, first = None, False
                if mom != 0:
                    entry = self.state.setdefault(i, {})
                    buf = entry.get("momentum_buffer")
                    if buf is None or buf.device != p.device:
                        # The first step makes the buffer g itself (PyTorch's clone).
                        buf = entry["momentum_buffer"] = zeros_like(p)
                        first = True
                # The rule the fused step runs too (ops::SgdStep), one pass per parameter.
                _core.sgd_step(p._t, g._t, None if buf is None else buf._t, group["lr"], mom,
                               group["dampening"], group["weight_decay"], group["nesterov"],
                               first)
                for changed in (p, buf):  # written in place, as an in-place op writes
                    if changed is not None:
                        changed._t.bump_version()

    def _momentum_list(self) -> List[Optional[Tensor]]:
        """The momentum buffer of every parameter, by position (None where there is none)."""
        bufs = self._buffers
        return [bufs.get(i) for i in range(len(self.params))]

    def _set_momentum_list(self, buffers: List[Optional[Tensor]]) -> None:
        for i, b in enumerate(buffers):
            if b is None:
                self.state.pop(i, None)
            else:
                self.state.setdefault(i, {})["momentum_buffer"] = b


class Adam(Optimizer):
    """Adam (Kingma and Ba) with PyTorch's update, defaults and state layout (per parameter
    ``step``, ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``). weight_decay adds
    weight_decay * p to the gradient (L2); :class:`AdamW` decouples it. Parameter groups as
    :class:`SGD`'s. The update of one parameter is one fused op (``_core.adam_step``, amsgrad
    included), the same the fused data-parallel step applies."""

    _hyper = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    _state_tensors = (("exp_avg", True), ("exp_avg_sq", True), ("max_exp_avg_sq", False))
    _decoupled = False

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": amsgrad})

    def _check_group(self, group, where):
        out = dict(group)
        out["lr"] = check_nonnegative(group["lr"], where, "lr")
        out["betas"] = check_betas(group["betas"], where)
        out["eps"] = check_nonnegative(group["eps"], where, "eps")
        out["weight_decay"] = check_nonnegative(group["weight_decay"], where,
                                               "weight_decay")
        if not isinstance(group["amsgrad"], (bool, int, np.bool_)):
            raise TypeError(f"{where}: amsgrad must be a bool, got "
                            f"{type(group['amsgrad']).__name__}")
        out["amsgrad"] = bool(group["amsgrad"])
        return out

    betas = _group_hyperparameter("betas")
    eps = _group_hyperparameter("eps")

    def _check_state_entry(self, i, entry, p, where):
        out = super()._check_state_entry(i, entry, p, where)
        if "step" not in entry:
            raise ValueError(f"{where}: state[{i}] must be a dict with a 'step'")
        try:
            step = float(entry["step"])
        except (TypeError, ValueError):
            raise TypeError(f"{where}: state[{i}]['step'] must be a number, got "
                            f"{type(entry['step']).__name__}") from None
        if not (step >= 0 and step == int(step)):
            raise ValueError(f"{where}: state[{i}]['step'] must be a whole number >= 0, got "
                             f"{step}")
        out["step"] = step
        return out

    def step(self) -> None:
        """Updates every parameter that has a gradient, in place (not recorded by autograd)."""
        with no_grad():
            for i, group, p, g in self._updates():
                entry = self.state.get(i)
                if entry is None or entry["exp_avg"].device != p.device:
                    entry = {"step": 0.0, "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)}
                    self.state[i] = entry
                vmax = None
                if group["amsgrad"]:
                    # A zero maximum where the state has none (amsgrad turned on later): the
                    # first step's maximum is then v itself.
                    vmax = entry.get("max_exp_avg_sq")
                    if vmax is None or vmax.device != p.device:
                        vmax = entry["max_exp_avg_sq"] = zeros_like(p)
                t = int(entry["step"]) + 1
                m, v = entry["exp_avg"], entry["exp_avg_sq"]
                _core.adam_step(p._t, g._t, m._t, v._t, group["lr"], group["betas"],
                                group["eps"], group["weight_decay"], self._decoupled, t,
                                None if vmax is None else vmax._t)
                for changed in (p, m, v, vmax):  # written in place, as an in-place op writes
                    if changed is not None:
                        changed._t.bump_version()
                entry["step"] = float(t)

    def _moment_lists(self, amsgrad: bool = False) -> Tuple[List[Optional[Tensor]], ...]:
        """exp_avg and exp_avg_sq (and with ``amsgrad`` max_exp_avg_sq) of every parameter by
        position (None where there is none)."""
        n = len(self.params)
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        return tuple([self.state[i].get(k) if i in self.state else None for i in range(n)]
                     for k in keys)

    def _steps(self) -> List[int]:
        """Every parameter's step count (0 before its first step)."""
        return [int(self.state[i]["step"]) if i in self.state else 0
                for i in range(len(self.params))]

    def _set_moments(self, m: List[Tensor], v: List[Tensor], step: int,
                     vmax: Optional[List[Tensor]] = None) -> None:
        for i, (a, b) in enumerate(zip(m, v)):
            self.state[i] = {"step": float(step), "exp_avg": a, "exp_avg_sq": b}
            if vmax is not None:
                self.state[i]["max_exp_avg_sq"] = vmax[i]


class AdamW(Adam):
    """AdamW (Loshchilov and Hutter): Adam with decoupled weight decay, p *= 1 - lr *
    weight_decay before the Adam step; PyTorch's defaults (weight_decay 0.01)."""

    _decoupled = True

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
