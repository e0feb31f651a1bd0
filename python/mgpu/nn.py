"""Losses and (PyTorch-shaped) modules for the chapters' networks.

The differentiable functional ops live in :mod:`mgpu.ops` (also reachable as
``mgpu.nn.functional``, PyTorch's ``F``); the modules here are built from them.
"""
from __future__ import annotations

from . import ops as functional
from .ops import cross_entropy
from .tensor import Tensor


class CrossEntropyLoss:
    """The chapter's ``loss``: per-example softmax cross-entropy (PyTorch/Gluon style callable)."""

    def __init__(self, reduction: str = "none"):
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        self.reduction = reduction

    def __call__(self, y_hat: Tensor, y: Tensor) -> Tensor:
        losses = cross_entropy(y_hat, y)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            return losses.mean()
        return losses


SoftmaxCrossEntropyLoss = CrossEntropyLoss  # Gluon's name
