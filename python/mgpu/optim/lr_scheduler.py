"""Learning-rate schedules with PyTorch's semantics (``torch.optim.lr_scheduler``).

A scheduler wraps an optimizer and sets each parameter group's ``'lr'``: at construction (step 0)
and at every ``step()``, which the training loop calls after ``optimizer.step()`` (per epoch or per
batch, as the schedule is meant). ``last_epoch`` counts the steps taken, ``get_last_lr()`` gives
the lrs the last step set, ``state_dict()`` / ``load_state_dict()`` save and restore the position.
The values are PyTorch's: where PyTorch updates the lr recursively from the group's current lr
(StepLR, MultiStepLR, LinearLR, CosineAnnealingLR), so does this module, in the same order of
floating-point operations, so a schedule matches PyTorch's float64 results, including when
another scheduler (SequentialLR) or the user changed the lr in between. OneCycleLR is computed in
closed form, as PyTorch's, and stepping it past ``total_steps`` raises (without stepping).

The fused step (``DataParallel.train_step``) reads each group's lr at every step, so a scheduler
drives it as it drives the book's loop.
"""
from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from .optimizers import Optimizer

__all__ = ["LRScheduler", "StepLR", "MultiStepLR", "LinearLR", "CosineAnnealingLR", "OneCycleLR",
           "SequentialLR", "SCHEDULES", "make_schedule"]


def _int(v, name: str, where: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {v}")
    return int(v)


def _real(v, name: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise TypeError(f"{where}: {name} must be a finite number, got {v!r}")
    return float(v)


def _check_optimizer(optimizer, where: str) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{where}: optimizer must be an mgpu.optim optimizer (SGD, Adam, AdamW), "
                        f"got {type(optimizer).__name__}")


class LRScheduler:
    """The base: ``base_lrs`` are the groups' ``'initial_lr'`` (set from their lr by the first
    scheduler made with ``last_epoch=-1``); ``step()`` advances ``last_epoch`` and sets every
    group's lr to ``get_lr()``."""

    def __init__(self, optimizer, last_epoch: int = -1):
        where = type(self).__name__
        _check_optimizer(optimizer, where)
        last_epoch = _int(last_epoch, "last_epoch", where, -1)
        if last_epoch == -1:
            for g in optimizer.param_groups:
                g.setdefault("initial_lr", g["lr"])
        else:
            for i, g in enumerate(optimizer.param_groups):
                if "initial_lr" not in g:
                    raise KeyError(f"{where}: param_groups[{i}] has no 'initial_lr', which "
                                   "resuming with last_epoch >= 0 needs; make the scheduler "
                                   "with last_epoch=-1 or restore the optimizer's state first")
        self.optimizer = optimizer
        self.base_lrs: List[float] = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self.step()

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def _check_step(self) -> None:
        """Raises, before anything changes, when the next step is out of the schedule."""

    def get_last_lr(self) -> List[float]:
        """The lrs the last step set, one per parameter group."""
        return list(self._last_lr)

    def step(self) -> None:
        """Advances the schedule by one step and sets every group's lr."""
        self._check_step()
        self._step_count += 1
        self.last_epoch += 1
        self._apply(self.get_lr())

    def _step_closed_form(self, epoch: int) -> None:
        """PyTorch's ``step(epoch)``: jumps to ``epoch`` and sets the closed-form lrs (the
        recursive ones where the schedule has no closed form). SequentialLR uses it to start a
        schedule at 0."""
        self._step_count += 1
        self.last_epoch = epoch
        closed = getattr(self, "_get_closed_form_lr", None)
        self._apply(closed() if closed is not None else self.get_lr())

    def _apply(self, lrs: List[float]) -> None:
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _lrs(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> Dict[str, Any]:
        """Every attribute but the optimizer (numbers and lists), as PyTorch's."""
        return {k: (list(v) if isinstance(v, (list, tuple)) else v)
                for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s values; checked first (same keys, same number of
        groups), so a dict of another scheduler changes nothing."""
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state_dict))
        if missing:
            raise ValueError(f"{where}: the dict has no {missing}; it is not this scheduler's "
                             "state_dict()")
        for key in ("base_lrs", "_last_lr"):
            got = state_dict[key]
            if not isinstance(got, (list, tuple)) or len(got) != len(mine[key]):
                raise ValueError(f"{where}: '{key}' must hold one value per parameter group "
                                 f"({len(mine[key])}), got {got!r}")
        _int(state_dict["last_epoch"], "last_epoch", where, -1)
        self._load_checked(state_dict)

    def _load_checked(self, state_dict: Dict[str, Any]) -> None:
        for k, v in state_dict.items():
            if k in self.__dict__ and k != "optimizer":
                self.__dict__[k] = list(v) if isinstance(v, tuple) else v

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_epoch={self.last_epoch}, lr={self._lrs()})"


class StepLR(LRScheduler):
    """lr = base_lr * gamma ** (last_epoch // step_size)."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = _int(step_size, "step_size", "StepLR", 1)
        self.gamma = _real(gamma, "gamma", "StepLR")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._lrs()
        return [lr * self.gamma for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [b * self.gamma ** (self.last_epoch // self.step_size) for b in self.base_lrs]


class MultiStepLR(LRScheduler):
    """lr = base_lr * gamma ** (number of milestones <= last_epoch)."""

    def __init__(self, optimizer, milestones: Sequence[int], gamma: float = 0.1,
                 last_epoch: int = -1):
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
            raise TypeError(f"MultiStepLR: milestones must be a list of ints, got {milestones!r}")
        ms = [_int(m, "a milestone", "MultiStepLR", 0) for m in milestones]
        self.milestones = dict(Counter(ms))
        self.gamma = _real(gamma, "gamma", "MultiStepLR")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        if self.last_epoch not in self.milestones:
            return self._lrs()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        ms = sorted(m for m, c in self.milestones.items() for _ in range(c))
        return [b * self.gamma ** bisect_right(ms, self.last_epoch) for b in self.base_lrs]

    def _load_checked(self, state_dict):
        super()._load_checked(state_dict)
        self.milestones = {int(k): int(v) for k, v in dict(self.milestones).items()}


class LinearLR(LRScheduler):
    """Warm-up: the factor goes linearly from start_factor to end_factor over total_iters
    steps, then stays; lr = base_lr * factor."""

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1):
        start = _real(start_factor, "start_factor", "LinearLR")
        end = _real(end_factor, "end_factor", "LinearLR")
        if not 0 < start <= 1:
            raise ValueError(f"LinearLR: start_factor must lie in (0, 1], got {start}")
        if not 0 <= end <= 1:
            raise ValueError(f"LinearLR: end_factor must lie in [0, 1], got {end}")
        self.start_factor, self.end_factor = start, end
        self.total_iters = _int(total_iters, "total_iters", "LinearLR", 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        s, e, n, t = self.start_factor, self.end_factor, self.total_iters, self.last_epoch
        if t == 0:
            return [lr * s for lr in self._lrs()]
        if t > n:
            return self._lrs()
        return [lr * (1.0 + (e - s) / (n * s + (t - 1) * (e - s))) for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        return [b * (s + (e - s) * min(n, self.last_epoch) / n) for b in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base_lr - eta_min) (1 + cos(pi last_epoch / T_max)) / 2, computed as
    PyTorch computes it: recursively from the current lr (so a lr changed in between is
    followed), continuing as a cosine past T_max."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):
        self.T_max = _int(T_max, "T_max", "CosineAnnealingLR", 1)
        self.eta_min = _real(eta_min, "eta_min", "CosineAnnealingLR")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        t, T, lo = self.last_epoch, self.T_max, self.eta_min
        if t == 0:
            return self._lrs()
        if self._step_count == 1 and t > 0:
            return [lo + (b - lo) * (1 + math.cos(t * math.pi / T)) / 2 for b in self.base_lrs]
        if (t - 1 - T) % (2 * T) == 0:
            return [lr + (b - lo) * (1 - math.cos(math.pi / T)) / 2
                    for lr, b in zip(self._lrs(), self.base_lrs)]
        return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
                * (lr - lo) + lo for lr in self._lrs()]

    def _get_closed_form_lr(self) -> List[float]:
        return [self.eta_min + (b - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch
                                                                  / self.T_max)) / 2
                for b in self.base_lrs]


class OneCycleLR(LRScheduler):
    """The 1cycle policy, stepped per batch: from max_lr / div_factor up to max_lr over the
    first pct_start of total_steps, then down to initial_lr / final_div_factor (three_phase:
    up, back down to the initial lr, then to the minimum), by cosine or linear annealing.
    With cycle_momentum (the default, as PyTorch's) it also cycles SGD's momentum (or Adam's
    beta1) between max_momentum and base_momentum, inversely. Stepping past total_steps raises
    ValueError and changes nothing."""

    def __init__(self, optimizer, max_lr, total_steps: Optional[int] = None,
                 epochs: Optional[int] = None, steps_per_epoch: Optional[int] = None,
                 pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: float = 0.85,
                 max_momentum: float = 0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1):
        where = "OneCycleLR"
        _check_optimizer(optimizer, where)
        if total_steps is not None:
            self.total_steps = _int(total_steps, "total_steps", where, 1)
        elif epochs is not None and steps_per_epoch is not None:
            self.total_steps = (_int(epochs, "epochs", where, 1)
                                * _int(steps_per_epoch, "steps_per_epoch", where, 1))
        else:
            raise ValueError("OneCycleLR: give total_steps, or epochs and steps_per_epoch")
        pct = _real(pct_start, "pct_start", where)
        if not 0 <= pct <= 1:
            raise ValueError(f"OneCycleLR: pct_start must lie in [0, 1], got {pct}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', got "
                             f"{anneal_strategy!r}")
        self.anneal_strategy = anneal_strategy
        n = self.total_steps
        if three_phase:
            self._schedule_phases = [
                {"end_step": float(pct * n) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
                 "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
                {"end_step": float(2 * pct * n) - 2, "start_lr": "max_lr",
                 "end_lr": "initial_lr", "start_momentum": "base_momentum",
                 "end_momentum": "max_momentum"},
                {"end_step": n - 1, "start_lr": "initial_lr", "end_lr": "min_lr",
                 "start_momentum": "max_momentum", "end_momentum": "max_momentum"}]
        else:
            self._schedule_phases = [
                {"end_step": float(pct * n) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
                 "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
                {"end_step": n - 1, "start_lr": "max_lr", "end_lr": "min_lr",
                 "start_momentum": "base_momentum", "end_momentum": "max_momentum"}]
        groups = optimizer.param_groups
        max_lrs = self._per_group(max_lr, "max_lr", len(groups))
        div = _real(div_factor, "div_factor", where)
        final_div = _real(final_div_factor, "final_div_factor", where)
        if div <= 0 or final_div <= 0:
            raise ValueError("OneCycleLR: div_factor and final_div_factor must be > 0")
        self.cycle_momentum = bool(cycle_momentum)
        moms = []
        if self.cycle_momentum:
            if not all("momentum" in g or "betas" in g for g in groups):
                raise ValueError("OneCycleLR: cycle_momentum needs an optimizer with momentum "
                                 "or betas (SGD, Adam, AdamW); pass cycle_momentum=False")
            bases = self._per_group(base_momentum, "base_momentum", len(groups))
            maxes = self._per_group(max_momentum, "max_momentum", len(groups))
            for b, m in zip(bases, maxes):
                if not 0 <= b < 1 or not 0 <= m < 1:
                    raise ValueError(f"OneCycleLR: base_momentum and max_momentum must lie in "
                                     f"[0, 1), got {b} and {m}")
            moms = list(zip(bases, maxes))
        self.use_beta1 = all("betas" in g for g in groups)
        if _int(last_epoch, "last_epoch", where, -1) == -1:
            for g, m in zip(groups, max_lrs):
                g["initial_lr"] = m / div
                g["max_lr"] = m
                g["min_lr"] = g["initial_lr"] / final_div
        if self.cycle_momentum and last_epoch == -1:
            for g, (b, m) in zip(groups, moms):
                if self.use_beta1:
                    g["betas"] = (m, *g["betas"][1:])
                else:
                    g["momentum"] = m
                g["max_momentum"] = m
                g["base_momentum"] = b
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _per_group(v, name: str, n: int) -> List[float]:
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise ValueError(f"OneCycleLR: expected {n} values for {name} (one per group), "
                                 f"got {len(v)}")
            return [_real(x, name, "OneCycleLR") for x in v]
        return [_real(v, name, "OneCycleLR")] * n

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _check_step(self) -> None:
        if self.last_epoch + 1 > self.total_steps:
            raise ValueError(f"OneCycleLR: tried to step {self.last_epoch + 1} times; the "
                             f"schedule has total_steps = {self.total_steps} (make it with the "
                             "number of batches the run takes: epochs * steps_per_epoch)")

    def get_lr(self) -> List[float]:
        t = self.last_epoch
        lrs = []
        for g in self.optimizer.param_groups:
            start_step = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end_step = phase["end_step"]
                if t <= end_step or i == len(self._schedule_phases) - 1:
                    pct = (t - start_step) / (end_step - start_step)
                    lr = self._anneal(g[phase["start_lr"]], g[phase["end_lr"]], pct)
                    if self.cycle_momentum:
                        mom = self._anneal(g[phase["start_momentum"]], g[phase["end_momentum"]],
                                           pct)
                    break
                start_step = phase["end_step"]
            lrs.append(lr)
            if self.cycle_momentum:
                if self.use_beta1:
                    g["betas"] = (mom, *g["betas"][1:])
                else:
                    g["momentum"] = mom
        return lrs


class SequentialLR(LRScheduler):
    """Runs ``schedulers`` one after another: schedulers[i] from milestones[i - 1] on, each
    started at its step 0 (its closed form at 0, as PyTorch's ``step(0)``)."""

    def __init__(self, optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1):
        where = "SequentialLR"
        _check_optimizer(optimizer, where)
        schedulers = list(schedulers)
        if not schedulers:
            raise ValueError("SequentialLR: expected at least one scheduler")
        for i, s in enumerate(schedulers):
            if not isinstance(s, LRScheduler) or isinstance(s, SequentialLR):
                raise TypeError(f"SequentialLR: schedulers[{i}] is {type(s).__name__}, "
                                "expected a scheduler of this module (not a SequentialLR)")
            if s.optimizer is not optimizer:
                raise ValueError(f"SequentialLR: schedulers[{i}] belongs to another optimizer; "
                                 "every scheduler must wrap the one given")
        milestones = [_int(m, "a milestone", where, 0) for m in milestones]
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR: expected {len(schedulers) - 1} milestones for "
                             f"{len(schedulers)} schedulers, got {len(milestones)}")
        if milestones != sorted(milestones):
            raise ValueError(f"SequentialLR: milestones must be increasing, got {milestones}")
        self._schedulers = schedulers
        self._milestones = milestones
        self.last_epoch = _int(last_epoch, "last_epoch", where, -1) + 1
        self.optimizer = optimizer
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self._step_count = 0
        # Undo the schedulers' own first steps, then take the first one's step 0.
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        for s in schedulers:
            s.last_epoch -= 1
        schedulers[0]._initial_step()
        self._last_lr = schedulers[0].get_last_lr()

    def _check_step(self) -> None:
        t = self.last_epoch + 1
        idx = bisect_right(self._milestones, t)
        if not (idx > 0 and self._milestones[idx - 1] == t):
            self._schedulers[idx]._check_step()

    def step(self) -> None:
        self._check_step()
        self._step_count += 1
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        s = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            s._step_closed_form(0)
        else:
            s.step()
        self._last_lr = s.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        """Its own position and every scheduler's state_dict (under ``_schedulers``)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        out["_milestones"] = list(self._milestones)
        out["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        where = "SequentialLR.load_state_dict"
        if not isinstance(state_dict, dict) or not isinstance(
                state_dict.get("_schedulers"), (list, tuple)):
            raise ValueError(f"{where}: expected SequentialLR.state_dict()'s dict")
        inner = state_dict["_schedulers"]
        if len(inner) != len(self._schedulers):
            raise ValueError(f"{where}: the dict holds {len(inner)} schedulers, this one has "
                             f"{len(self._schedulers)}")
        if list(state_dict.get("_milestones", [])) != self._milestones:
            raise ValueError(f"{where}: the dict's milestones {state_dict.get('_milestones')} "
                             f"differ from this scheduler's {self._milestones}")
        # Every part is checked on a throwaway copy first, so a bad one changes nothing.
        import copy
        for s, sd in zip(self._schedulers, inner):
            probe = copy.copy(s)
            probe.__dict__ = dict(s.__dict__)
            probe.load_state_dict(sd)
        outer = {k: v for k, v in state_dict.items() if k != "_schedulers"}
        LRScheduler.load_state_dict(self, dict(outer, _schedulers=None))
        for s, sd in zip(self._schedulers, inner):
            s.load_state_dict(sd)

    def _load_checked(self, state_dict):
        for k, v in state_dict.items():
            if k in self.__dict__ and k not in ("optimizer", "_schedulers"):
                self.__dict__[k] = list(v) if isinstance(v, tuple) else v


# --- the recipes of train, train_concise and the CLI (--schedule, --warmup-epochs) -------------

SCHEDULES = ("none", "step", "cosine", "onecycle")


def make_schedule(trainer, schedule: str, num_epochs: int, steps_per_epoch: int,
                  warmup_epochs: int = 0):
    """A learning-rate schedule stepped after every batch, or None for a constant lr:
    ``step`` divides the lr by 10 at half and at three quarters of the run, ``cosine`` anneals
    it to 0 by the end, ``onecycle`` is ``OneCycleLR`` with the lr as its peak. ``warmup_epochs``
    first raises the lr linearly from lr / W to lr over its W steps (for onecycle it is the
    rising phase: pct_start = warmup_epochs / num_epochs)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) \
            or not 0 <= warmup_epochs < max(1, num_epochs):
        raise ValueError(f"warmup_epochs must be an int in [0, num_epochs = {num_epochs}), got "
                         f"{warmup_epochs!r}")
    if schedule == "none" and not warmup_epochs:
        return None
    total, warm = num_epochs * steps_per_epoch, warmup_epochs * steps_per_epoch
    if total < 1:
        raise ValueError("a schedule needs at least one training batch")
    if schedule == "onecycle":
        lr = trainer.param_groups[0]["lr"]
        pct = warmup_epochs / num_epochs if warmup_epochs else 0.3
        return OneCycleLR(trainer, max_lr=lr, total_steps=total, pct_start=pct)
    main = None
    if schedule == "step":
        main = MultiStepLR(trainer, [(total - warm) // 2, 3 * (total - warm) // 4])
    elif schedule == "cosine":
        main = CosineAnnealingLR(trainer, T_max=max(1, total - warm))
    if not warm:
        return main
    warmup = LinearLR(trainer, start_factor=1.0 / warm, total_iters=warm)
    if main is None:
        return warmup
    return SequentialLR(trainer, [warmup, main], milestones=[warm])
