"""The fused step's layer list (``DataParallel.train_step``): a module tree becomes the spec that
``mgpu._core.Model`` is built from (via ``parallel.FusedModel``), layers over value slots.

Each module class the fused step runs has one small emit here, registered with ``@emits(cls)``
in one table; ``SpecBuilder.emit`` walks a tree through that table, and the table alone says
what is supported (the ``NotImplementedError`` for any other module lists its entries).
``SyncBatchNorm`` registers its emit where the class lives (``data_parallel``)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import nn
from .engine import core as _core
from .models import Residual
from .nn import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm2d,
    BatchNormBase,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    Module,
    ReLU,
    Sequential,
)
from .tensor import Tensor

# emit(builder, module, slot it reads) -> the slot its last layer writes, or None: the module is
# of this class but not one the step can run (an AvgPool2d with a non-square window).
Emit = Callable[["SpecBuilder", Module, int], Optional[int]]

# class -> (emit, exact, condition), tried in registration order: ``exact`` takes modules of
# that very class only, otherwise its subclasses too; ``condition`` names what a module must
# also satisfy, for the error message.
_EMITS: Dict[type, Tuple[Emit, bool, str]] = {}

# Layer kinds whose products run with bfloat16 operands under precision="bf16": those whose
# record (cpp/train/kinds/) takes the option bf16.
_BF16_KINDS = frozenset(kind for kind, options in _core.layer_kinds() if "bf16" in options)


def emits(cls: type, exact: bool = False, condition: str = "") -> Callable[[Emit], Emit]:
    """Registers the decorated ``emit(b, m, src)`` as the layers of a module of class ``cls``
    (a subclass too unless ``exact``); ``condition`` says what else such a module must be for
    the step to run it (the emit returns None otherwise, and the entries after it are tried)."""
    def register(fn: Emit) -> Emit:
        _EMITS[cls] = (fn, exact, condition)
        return fn
    return register


def emitted_classes() -> List[type]:
    """The module classes the fused step runs, in the order they are tried."""
    return list(_EMITS)


def _label(cls: type) -> str:
    # nn's classes (SyncBatchNorm is added to nn by data_parallel) by their bare names, others
    # with their module's (models.Residual).
    if getattr(nn, cls.__name__, None) is cls:
        return cls.__name__
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def supported_modules() -> str:
    """The emit table as a sentence: what the fused step runs."""
    names = [_label(c) + (f" ({cond})" if cond else "") for c, (_, _, cond) in _EMITS.items()]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


class SpecBuilder:
    """The spec of one module tree: ``spec`` lists (kind, options) layers, slot 0 holding the
    input and layer i writing slot i + 1; ``buffers`` the buffers the layers name by index;
    ``dropout`` whether some layer draws dropout masks (each step then draws a seed)."""

    def __init__(self, params: Sequence[Tensor], bf16: bool = False):
        self._pindex = {id(p): i for i, p in enumerate(params)}
        self._bf16 = bf16
        self.spec: List[tuple] = []
        self.buffers: List[Tensor] = []
        self.dropout = False

    def layer(self, kind: str, src: int, params=(), buffers=(), **opts) -> int:
        """Appends a layer reading slot ``src`` (its parameters and buffers by index) and
        returns the slot it writes."""
        opts["in"] = src
        opts["params"] = [self._pindex[id(p)] for p in params]
        if self._bf16 and kind in _BF16_KINDS:
            opts["bf16"] = True
        if buffers:
            opts["buffers"] = []
            for b in buffers:
                opts["buffers"].append(len(self.buffers))
                self.buffers.append(b)
        self.spec.append((kind, opts))
        return len(self.spec)

    def add(self, a: int, b: int) -> int:
        """Appends the sum of slots ``a`` and ``b``; returns the slot it writes."""
        self.spec.append(("add", {"in": [a, b]}))
        return len(self.spec)

    def emit(self, m: Module, src: int) -> int:
        """Appends module ``m``'s layers reading slot ``src``; returns the slot of its output."""
        for cls, (fn, exact, _) in _EMITS.items():
            if type(m) is cls if exact else isinstance(m, cls):
                out = fn(self, m, src)
                if out is not None:
                    return out
        raise NotImplementedError(
            f"train_step: the fused step has no layer for {type(m).__name__}; supported are "
            f"{supported_modules()}; use the book's loop for other modules")


def _weight_and_bias(m: Module) -> list:
    return [m.weight] + ([m.bias] if m.bias is not None else [])


@emits(Sequential)
def _sequential(b: SpecBuilder, m: Sequential, src: int) -> int:
    for child in m:
        src = b.emit(child, src)
    return src


@emits(Conv2d)
def _conv2d(b: SpecBuilder, m: Conv2d, src: int) -> int:
    return b.layer("conv2d", src, _weight_and_bias(m), stride=m.stride, padding=m.padding,
                   bias=m.bias is not None)


def batch_norm(b: SpecBuilder, m: BatchNormBase, src: int, sync: bool) -> Optional[int]:
    """A batch norm layer (``sync``: statistics over every replica and rank), for modules with
    running statistics and a momentum (the C++ step keeps no cumulative average)."""
    if not m.track_running_stats or m.momentum is None:
        return None
    ps = [m.weight, m.bias] if m.affine else []
    return b.layer("batch_norm", src, ps, [m.running_mean, m.running_var], eps=m.eps,
                   momentum=float(m.momentum), affine=m.affine, sync=sync)


BATCH_NORM_CONDITION = "with running statistics and a momentum"


@emits(BatchNorm2d, exact=True, condition=BATCH_NORM_CONDITION)
def _batch_norm2d(b: SpecBuilder, m: BatchNorm2d, src: int) -> Optional[int]:
    return batch_norm(b, m, src, sync=False)


@emits(ReLU)
def _relu(b: SpecBuilder, m: ReLU, src: int) -> int:
    return b.layer("relu", src)


@emits(Flatten)
def _flatten(b: SpecBuilder, m: Flatten, src: int) -> int:
    return b.layer("flatten", src)


@emits(AdaptiveAvgPool2d, condition="output size (1, 1)")
def _adaptive_avg_pool2d(b: SpecBuilder, m: AdaptiveAvgPool2d, src: int) -> int:
    return b.layer("global_avg_pool", src)  # the only output size nn.AdaptiveAvgPool2d takes


@emits(AvgPool2d, condition="square")
def _avg_pool2d(b: SpecBuilder, m: AvgPool2d, src: int) -> Optional[int]:
    if m.kernel_size[0] != m.kernel_size[1] or m.stride[0] != m.stride[1]:
        return None
    return b.layer("avg_pool2d", src, kernel=m.kernel_size[0], stride=m.stride[0])


@emits(MaxPool2d, condition="square")
def _max_pool2d(b: SpecBuilder, m: MaxPool2d, src: int) -> Optional[int]:
    if m.kernel_size[0] != m.kernel_size[1] or m.stride[0] != m.stride[1] \
            or m.padding[0] != m.padding[1]:
        return None
    return b.layer("max_pool2d", src, kernel=m.kernel_size[0], stride=m.stride[0],
                   padding=m.padding[0])


@emits(Dropout)
def _dropout(b: SpecBuilder, m: Dropout, src: int) -> int:
    if m.p == 0.0:
        return src  # the identity
    b.dropout = True
    return b.layer("dropout", src, p=m.p)


@emits(Linear)
def _linear(b: SpecBuilder, m: Linear, src: int) -> int:
    # round_db: under bf16 the bias gradient sums the rounded dy, as ops.linear's does.
    return b.layer("linear", src, _weight_and_bias(m), bias=m.bias is not None, transpose=True,
                   round_db=True)


@emits(Residual, exact=True)
def _residual(b: SpecBuilder, m: Residual, src: int) -> int:
    y = b.emit(m.bn1, b.emit(m.conv1, src))
    y = b.emit(m.bn2, b.emit(m.conv2, b.layer("relu", y)))
    short = b.emit(m.conv3, src) if m.conv3 is not None else src
    return b.layer("relu", b.add(y, short))
