"""``mgpu.optim.swa_utils.update_bn`` (PyTorch's ``torch.optim.swa_utils.update_bn``): batch
norm's running statistics recomputed from data for the weights a model has now.

After training, a BatchNorm layer's running statistics are an exponential average (momentum 0.1)
over the batches it saw, taken while the weights below it were still changing. ``update_bn``
resets them and feeds ``loader``'s inputs through the model in training mode with momentum
None, so that each layer ends with the plain average of its batches' means and unbiased
variances under the final weights. Evaluation then uses those.
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..autograd import no_grad
from ..device import Device
from ..nn import BatchNormBase, Module

__all__ = ["update_bn"]


def update_bn(loader: Iterable, model: Module, device: Optional[Device] = None) -> None:
    """Recomputes the running statistics of every batch-norm layer of ``model`` that tracks
    them, from the inputs ``loader`` yields (an item may be an input, or a tuple or list whose
    first element is the input: a data loader's (X, y)), each moved to ``device`` when given.

    As PyTorch's: the statistics are reset, every such layer's momentum is None during the pass
    (a cumulative average: the plain mean over the batches), the model runs in training mode
    without recording gradients, and afterwards each momentum and the model's training mode are
    what they were. A model without such layers is left untouched and ``loader`` unread. An
    empty loader leaves the statistics reset (mean 0, variance 1)."""
    if not isinstance(model, Module):
        raise TypeError(f"update_bn: model must be an mgpu.nn.Module, got {type(model).__name__}")
    layers = [m for m in model.modules()
              if isinstance(m, BatchNormBase) and m.track_running_stats]
    if not layers:
        return
    momenta = [m.momentum for m in layers]
    was_training = model.training
    for m in layers:
        m.reset_running_stats()
        m.momentum = None
    try:
        model.train()
        with no_grad():
            for item in loader:
                x = item[0] if isinstance(item, (tuple, list)) else item
                model(x.to(device) if device is not None else x)
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
        model.train(was_training)
