"""Optimizers for ``mgpu.nn`` modules (PyTorch's ``torch.optim``), used by the concise chapter
(sec. 12.6): ``trainer = mgpu.optim.SGD(net.parameters(), lr)``; ``trainer.step()``.

Every optimizer takes parameters or parameter groups (dicts with ``'params'`` and any of the
optimizer's hyperparameters, as PyTorch's), keeps them in ``param_groups`` (a learning-rate
scheduler, ``mgpu.optim.lr_scheduler``, changes their ``'lr'``), and saves and restores its state
with ``state_dict`` / ``load_state_dict`` in PyTorch's layout (state by parameter position).

SGD follows PyTorch's update exactly: g = grad + weight_decay * p; with momentum,
b = g on the first step, else b = momentum * b + (1 - dampening) * g, and g = g + momentum * b
(Nesterov) or g = b; then p = p - lr * g.

Adam and AdamW follow PyTorch's at step t (counted from 1): Adam adds weight_decay * p to g (L2
in the gradient), AdamW multiplies p by 1 - lr * weight_decay first (decoupled weight decay); then
m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2, and
p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps). amsgrad keeps the largest
v seen and divides by it instead (in the book's loop and the fused step alike).

``swa_utils.update_bn(loader, model)`` recomputes batch norm's running statistics from data, as
PyTorch's does.
"""
from . import lr_scheduler, swa_utils
from .optimizers import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler", "swa_utils"]
