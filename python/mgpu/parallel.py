"""Data parallelism, the chapter's way (sec. 12.5.4-12.5.6): replicate parameters, sum gradients,
split minibatches, take the same SGD step everywhere -- and the fused ``train_batch`` that does all
of it in one C++ call.
"""
from __future__ import annotations

import numbers
from typing import List, Sequence, Tuple

import numpy as np

from . import _core
from . import distributed as _dist
from .device import Device, as_device
from .tensor import Tensor, _handle, _int


def get_params(params: Sequence[Tensor], device: Device) -> List[Tensor]:
    """Copies the parameters to ``device`` and attaches zero gradients to the copies."""
    new_params = [p.copyto(as_device(device)) for p in params]
    for p in new_params:
        p.attach_grad()
    return new_params


def _flat_tensors(data) -> List[List["_core.Tensor"]]:
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("allreduce: pass a non-empty list with one tensor (or one list of "
                         "tensors) per device")
    out = []
    for i, entry in enumerate(data):
        items = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        for t in items:
            if not isinstance(t, Tensor):
                raise TypeError(f"allreduce: entry {i} holds {type(t).__name__}, expected mgpu "
                                "tensors (a .grad that is None has not been attached)")
        out.append([t._t for t in items])
    return out


def allreduce(data) -> None:
    """Sums tensors across devices in place; afterwards every device holds the sum.

    ``data`` has one entry per device: a tensor, or a list of tensors (all reduced as one flat
    buffer in a single collective -- the efficient all-reduce of the chapter's exercise).
    """
    _core.allreduce(_flat_tensors(data))
    for entry in data:  # summed in place
        for t in (entry if isinstance(entry, (list, tuple)) else [entry]):
            t._t.bump_version()


def split_batch(X: Tensor, y: Tensor, devices: Sequence[Device]) -> Tuple[List[Tensor], List[Tensor]]:
    """Splits X and y along axis 0 into one shard per device (sizes differ by at most one)."""
    _handle(X, "split_batch", "X"), _handle(y, "split_batch", "y")
    if X.shape[:1] != y.shape[:1]:
        raise ValueError(f"split_batch: X and y must hold the same number of examples, got "
                         f"X {X.shape} and y {y.shape}")
    devices = [as_device(d) for d in devices]
    return ([Tensor(t) for t in _core.split_rows(X._t, devices)],
            [Tensor(t) for t in _core.split_rows(y._t, devices)])


def split_and_load(data: Tensor, devices: Sequence[Device]) -> List[Tensor]:
    """Gluon's name: splits one tensor along axis 0 over the devices."""
    return [Tensor(t) for t in _core.split_rows(_handle(data, "split_and_load", "data"),
                                                [as_device(d) for d in devices])]


def _check_lr(lr, op: str) -> float:
    """``lr`` as a float; ValueError unless it is a finite number > 0 (NaN would train silently)."""
    if isinstance(lr, bool) or not isinstance(lr, (numbers.Real, np.number)):
        raise TypeError(f"{op}: lr must be a number, got {type(lr).__name__}")
    lr = float(lr)
    if not (np.isfinite(lr) and lr > 0):
        raise ValueError(f"{op}: the learning rate must be a finite number > 0, got {lr}")
    return lr


def _check_batch_size(batch_size, op: str) -> int:
    n = _int(batch_size, op, "batch_size")
    if n < 1:
        raise ValueError(f"{op}: batch_size must be >= 1, got {n}")
    return n


def _scale(lr: float, batch_size: int) -> float:
    # float32 arithmetic, exactly as the fused step computes lr / N in C++.
    return float(np.float32(lr) / np.float32(batch_size))


def sgd(params: Sequence[Tensor], lr: float, batch_size: int) -> None:
    """Minibatch SGD in place: p -= lr * p.grad / batch_size, then the gradients are zeroed."""
    scale = _scale(_check_lr(lr, "sgd"), _check_batch_size(batch_size, "sgd"))
    params = list(params)
    for i, p in enumerate(params):  # all checked before any is changed
        _handle(p, "sgd", f"params[{i}]")
        if p.grad is None:
            raise ValueError("sgd: a parameter has no gradient; attach one with attach_grad() "
                             "or requires_grad_() and run backward() first")
    for p in params:
        _core.sgd_update(p._t, p.grad._t, scale)
        p._t.bump_version()
        p.grad.zero_()


def _replicas(device_params, devices) -> Tuple[list, list]:
    devices = [as_device(d) for d in devices]
    handles = []
    for i, ps in enumerate(device_params):
        if not isinstance(ps, (list, tuple)):
            raise TypeError(f"device_params[{i}] must be a list of the parameters on devices[{i}]")
        handles.append([_handle(p, "train_batch", f"device_params[{i}][{j}]")
                        for j, p in enumerate(ps)])
    return handles, devices


def train_batch(X: Tensor, y: Tensor, device_params, devices: Sequence[Device],
                lr: float) -> List[Tensor]:
    """One fused data-parallel LeNet step (GIL released, every device at once).

    Splits the minibatch over ``devices``, computes each shard's loss and gradients on its
    device, sums the gradients across devices, and updates every replica in place with
    p -= lr * grad / X.shape[0]. Returns each device's summed loss (0-d tensors). Under mpirun
    (``mgpu.distributed``) X, y are the global batch on every rank: each rank trains on its slice
    and gradients are summed across processes too, so all ranks take the global step.
    """
    lr = _check_lr(lr, "train_batch")
    Xh, yh = _handle(X, "train_batch", "X"), _handle(y, "train_batch", "y")
    _dist._auto_init()
    handles, devices = _replicas(device_params, devices)
    losses = [Tensor(t) for t in _core.train_batch(Xh, yh, handles, devices, lr)]
    for ps in device_params:  # updated in place
        for p in ps:
            p._t.bump_version()
    return losses


def evaluate_counts(X: Tensor, y: Tensor, device_params, devices: Sequence[Device]) -> List[Tensor]:
    """Correct predictions of the replicas on one batch, split over the devices (0-d each)."""
    Xh, yh = _handle(X, "evaluate_accuracy", "X"), _handle(y, "evaluate_accuracy", "y")
    handles, devices = _replicas(device_params, devices)
    return [Tensor(t) for t in _core.evaluate_batch(Xh, yh, handles, devices)]
