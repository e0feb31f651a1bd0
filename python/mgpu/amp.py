"""Mixed precision for the book's loop: ``with mgpu.autocast("bf16"):`` runs the matrix products
(``conv2d``, ``linear``, ``mm``) with bfloat16 operands and float32 sums, PyTorch's CPU autocast
for those ops; batch norm, the loss, softmax, pooling and the optimizer stay float32, and so do
the tensors: parameters (the master weights), activations and gradients are float32 throughout.
The operands are rounded to bfloat16 where the C++ kernels pack them, or, for a convolution
whose float32 kernel is faster on the CPU (Winograd at ResNet-18's 3x3 layers), as that kernel
reads them (cpp/ops/bf16.h says how, and what error that costs); outputs are float32, where
PyTorch's autocast outputs bfloat16 tensors (mgpu's bfloat16 tensors, ``mgpu.bfloat16``, hold
data for interop and checkpoints; ops take float32 tensors). A conv's or linear layer's bias
gradient is the float32 sum of the bfloat16-rounded output gradient, the one its products see.

An op records the precision it ran with, and its backward (dx, dW) runs with the same, as
PyTorch's does, whether ``backward()`` is called inside the block or after it::

    with mgpu.autocast("bf16"):
        loss = loss_fn(net(X), y)
    loss.sum().backward()          # conv and linear gradients in bf16 too

The state is per thread (each thread starts in float32) and blocks nest:
``autocast(enabled=False)`` inside a bf16 block runs float32. bf16 runs on CPU devices and GPUs
alike: mgpu's CUDA kernels sum in the order of the CPU's bfloat16 products
(``MGPU_CONV_ALGO=direct``) and give their bits (cpp/ops/bf16_gpu.h, which also states the
bounds of cuBLAS and cuDNN where they run).
"""
from __future__ import annotations

import threading

_PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "float32": "float32", "fp32": "float32"}
_state = threading.local()


def get_precision() -> str:
    """The precision the matrix products of this thread run with now: "float32" or "bf16"."""
    return getattr(_state, "precision", "float32")


def check_precision(precision: str, what: str = "precision") -> str:
    """The canonical name ("float32" or "bf16") of a precision; ValueError for anything else."""
    if not isinstance(precision, str) or precision.lower() not in _PRECISIONS:
        raise ValueError(f"{what} must be 'float32' or 'bf16' (bfloat16 operands, float32 sums), "
                         f"got {precision!r}")
    return _PRECISIONS[precision.lower()]


def check_comm_dtype(comm_dtype, what: str = "comm_dtype") -> str:
    """The canonical name ("float32" or "bf16") of the dtype gradients are all-reduced in: a
    name ("bf16", "bfloat16", "float32", "fp32") or ``mgpu.bfloat16`` / ``mgpu.float32``;
    ValueError for anything else."""
    name = getattr(comm_dtype, "name", comm_dtype)
    if not isinstance(name, str) or name.lower() not in _PRECISIONS:
        raise ValueError(f"{what} must be 'float32' or 'bf16' (gradients rounded to bfloat16 for "
                         f"the all-reduce, half the bytes), got {comm_dtype!r}")
    return _PRECISIONS[name.lower()]


class autocast:
    """Context manager (and decorator) running conv2d, linear and mm in ``dtype`` in its block:
    ``"bf16"`` (or ``"bfloat16"``) or ``"float32"``; ``enabled=False`` runs float32. See the
    module's docstring."""

    def __init__(self, dtype: str = "bf16", enabled: bool = True):
        self.precision = check_precision(dtype, "autocast: dtype") if enabled else "float32"
        self._saved = []

    def __enter__(self):
        self._saved.append(get_precision())
        _state.precision = self.precision
        return self

    def __exit__(self, *exc):
        _state.precision = self._saved.pop()
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(self.precision):
                return fn(*args, **kwargs)
        return wrapper
