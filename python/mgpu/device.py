"""Devices, as the chapter names them: ``cpu(i)``, ``gpu(i)``, ``try_gpu(i)``, ``try_all_gpus()``.

CPU devices are virtual: ``cpu(0)`` and ``cpu(1)`` are distinct execution contexts, each with its
own worker thread and its own tensors, so multi-device code runs in parallel without any GPU and
``try_gpu(i)`` keeps its meaning on a laptop.
"""
from __future__ import annotations

from typing import List

from .engine import core as _core

Device = _core.Device


def cpu(i: int = 0) -> Device:
    """The virtual CPU device ``cpu(i)``."""
    return _core.Device(_core.DeviceKind.CPU, int(i))


def gpu(i: int = 0) -> Device:
    """The GPU ``gpu(i)``; raises ``IndexError`` when this machine or build has no such GPU."""
    return _core.Device(_core.DeviceKind.CUDA, int(i))


def num_gpus() -> int:
    """How many GPUs this build can use (0 without CUDA or without a GPU)."""
    return _core.num_gpus()


def try_gpu(i: int = 0) -> Device:
    """``gpu(i)`` if it exists, else the virtual CPU device ``cpu(i)``."""
    return gpu(i) if i < num_gpus() else cpu(i)


def try_all_gpus() -> List[Device]:
    """Every GPU, or ``[cpu(0)]`` when there is none."""
    n = num_gpus()
    return [gpu(i) for i in range(n)] if n else [cpu(0)]


def as_device(d) -> Device:
    """Accepts a Device, or the strings 'cpu', 'cpu:1', 'gpu:0', 'cuda:0'."""
    if isinstance(d, Device):
        return d
    if isinstance(d, str):
        kind, _, idx = d.partition(":")
        index = int(idx) if idx else 0
        if kind == "cpu":
            return cpu(index)
        if kind in ("gpu", "cuda"):
            return gpu(index)
    raise TypeError(f"expected a device such as mgpu.cpu(0) or mgpu.gpu(0), got {d!r}")
