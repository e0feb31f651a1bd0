"""Losses and PyTorch-shaped modules for the chapters' networks (sec. 12.6: ``mgpu.nn``).

``Module`` registers parameters, buffers and submodules assigned as attributes; the layers
(``Conv2d``, ``BatchNorm2d``, ``Linear``, ...) compute with the differentiable ops of
:mod:`mgpu.ops` (also reachable as ``mgpu.nn.functional``, PyTorch's ``F``). ``nn.init`` draws
with mgpu.random (seedable). ``DataParallel`` and ``SyncBatchNorm`` live in data_parallel.py.
"""
from __future__ import annotations

import math
import numbers
import sys
import threading
from collections import OrderedDict
from typing import Callable, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import ops as functional
from . import random as _random
from . import weights
from .autograd import zero_grads
from .device import Device, as_device
from .engine import core as _core
from .ops import IntPair, cross_entropy
from .tensor import Tensor, array, ones, zeros

# --- modules ---------------------------------------------------------------------------------

def _as_tensor(value, what: str, device=None) -> Tensor:
    """A Tensor from a Tensor or a NumPy array (copied to ``device``); anything else is a
    TypeError naming ``what``."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return array(value, device=device)
    raise TypeError(f"{what}: expected an mgpu tensor or a NumPy array, got {type(value).__name__}")


class Parameter(Tensor):
    """A tensor that is a module's parameter: it requires grad and ``Module`` registers it."""

    __slots__ = ()

    def __init__(self, data: Union[Tensor, np.ndarray], requires_grad: bool = True):
        data = _as_tensor(data, "Parameter")
        super().__init__(data._t, requires_grad=False)
        if requires_grad:
            self.requires_grad_()

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    __str__ = __repr__


class _IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


class Module:
    """Base class of every layer and network (PyTorch's ``nn.Module``).

    Assigning a :class:`Parameter` or a ``Module`` to an attribute registers it; buffers (state
    that is not trained, such as BatchNorm's running statistics) are registered with
    :meth:`register_buffer`. ``module(x)`` calls :meth:`forward`.
    """

    training: bool

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward(); a Module "
                                  "subclass must implement it")

    def __call__(self, *args, **kwargs):
        if getattr(module_calls, "depth", 0) > 0:
            return self.forward(*args, **kwargs)
        # The outermost call undoes BatchNorm's running-statistics updates if the forward fails
        # part way (an input too small for a later layer), so a failed call changes nothing.
        saved = _save_running_stats(self)
        module_calls.depth = 1
        try:
            return self.forward(*args, **kwargs)
        except BaseException:
            _restore_running_stats(saved)
            raise
        finally:
            module_calls.depth = 0

    # --- registration ----------------------------------------------------------------------
    def _check_init(self, what: str) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"cannot assign {what} before Module.__init__() has run; call "
                               f"super().__init__() first in {type(self).__name__}.__init__")

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            self._check_init("a parameter")
            self._forget(name)
            params[name] = value
        elif isinstance(value, Module):
            self._check_init("a submodule")
            self._forget(name)
            self._modules[name] = value
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to parameter '{name}' of "
                                f"{type(self).__name__}; assign an mgpu.nn.Parameter (or None)")
            params[name] = None
        elif params is not None and name in self._buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign {type(value).__name__} to buffer '{name}' of "
                                f"{type(self).__name__}; assign an mgpu tensor (or None)")
            self._buffers[name] = value
        elif params is not None and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to submodule '{name}' of "
                                f"{type(self).__name__}; assign an mgpu.nn.Module (or None)")
            self._modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name: str) -> None:
        self.__dict__.pop(name, None)
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        self._non_persistent.discard(name)

    def __getattr__(self, name: str):
        # Only called when normal lookup fails: parameters, buffers and submodules live in dicts.
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if store in d and name in d[store]:
                return d[store][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for store in (self._parameters, self._buffers, self._modules):
            if name in store:
                del store[name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def _check_name(self, name, what: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{what} name must be a str, got {type(name).__name__}")
        if not name or "." in name:
            raise ValueError(f"{what} name must be non-empty and contain no '.', got {name!r}")
        if name in self.__dict__ and name not in ("training",):
            raise ValueError(f"{what} name {name!r} is already an attribute of "
                             f"{type(self).__name__}")

    def register_parameter(self, name: str, param: Optional[Parameter]) -> None:
        """Adds a parameter (or a None placeholder) under ``name``."""
        self._check_init("a parameter")
        self._check_name(name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: '{name}' must be an mgpu.nn.Parameter or None, "
                            f"got {type(param).__name__}; wrap a tensor as nn.Parameter(t)")
        self._forget(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Optional[Tensor], persistent: bool = True) -> None:
        """Adds a buffer: state saved in state_dict and moved by to(), but not trained."""
        self._check_init("a buffer")
        self._check_name(name, "buffer")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"register_buffer: '{name}' must be an mgpu tensor or None, got "
                            f"{type(tensor).__name__}")
        self._forget(name)
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Optional["Module"]) -> None:
        """Adds a child module under ``name``."""
        self._check_init("a submodule")
        self._check_name(name, "module")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module: '{name}' must be an mgpu.nn.Module or None, got "
                            f"{type(module).__name__}")
        self._forget(name)
        self._modules[name] = module

    register_module = add_module

    # --- traversal -------------------------------------------------------------------------
    def named_modules(self, memo: Optional[set] = None, prefix: str = ""
                      ) -> Iterator[Tuple[str, "Module"]]:
        """Every module of the tree, this one first, each once (depth first)."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[Tuple[str, "Module"]]:
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, store: str, prefix: str, recurse: bool):
        seen = set()
        mods = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for mod_prefix, m in mods:
            for name, t in getattr(m, store).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[Tuple[str, Parameter]]:
        """(name, parameter) pairs, each shared parameter once, e.g. ``'0.weight'``."""
        return self._named_members("_parameters", prefix, recurse)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True
                      ) -> Iterator[Tuple[str, Tensor]]:
        return self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # --- modes, hooks, devices -------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Training mode (BatchNorm uses batch statistics); returns self."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode): mode must be a bool, got {type(mode).__name__}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        """Evaluation mode (BatchNorm uses its running statistics); returns self."""
        return self.train(False)

    def apply(self, fn: Callable[["Module"], None]) -> "Module":
        """Calls ``fn`` on every submodule (children first) and then on this one; returns self."""
        if not callable(fn):
            raise TypeError(f"apply: fn must be callable, got {type(fn).__name__}")
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def to(self, device) -> "Module":
        """Moves every parameter and buffer to ``device`` in place (the Parameter objects stay
        the same, so an optimizer made earlier still holds them); returns self."""
        device = as_device(device)
        for t in list(self.parameters()) + list(self.buffers()):
            _move_tensor(t, device)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every parameter's gradient (to None, or to zeros with set_to_none=False)."""
        zero_grads(self.parameters(), set_to_none)

    # --- state -----------------------------------------------------------------------------
    def state_dict(self, prefix: str = "") -> "OrderedDict[str, Tensor]":
        """Parameters and persistent buffers by name, as tensors sharing their memory."""
        out: "OrderedDict[str, Tensor]" = OrderedDict()
        for mod_prefix, m in self.named_modules(prefix=prefix):
            for name, p in m._parameters.items():
                if p is not None:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = p.detach()
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent:
                    out[f"{mod_prefix}.{name}" if mod_prefix else name] = b.detach()
        return out

    def _state_targets(self) -> "OrderedDict[str, Tensor]":
        out: "OrderedDict[str, Tensor]" = OrderedDict()
        for mod_prefix, m in self.named_modules():
            for store in (m._parameters, m._buffers):
                for name, t in store.items():
                    if t is not None and (store is m._parameters or name not in m._non_persistent):
                        out[f"{mod_prefix}.{name}" if mod_prefix else name] = t
        return out

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> _IncompatibleKeys:
        """Copies values into the parameters and buffers of the same names, PyTorch's way
        (:mod:`mgpu.weights`): PyTorch's names, DataParallel's ``module.`` prefix dropped, values
        as mgpu tensors, NumPy arrays or anything with ``__dlpack__`` (PyTorch tensors).

        Every entry is checked first (names with ``strict``, shapes always, types): on any
        mismatch a ValueError (TypeError for a non-tensor) lists the problems and nothing is
        changed. Returns (missing_keys, unexpected_keys) like PyTorch.
        """
        optional = frozenset(f"{p}.num_batches_tracked" if p else "num_batches_tracked"
                             for p, m in self.named_modules() if isinstance(m, BatchNormBase))
        missing, unexpected = weights.load_into(type(self).__name__, self._state_targets(),
                                                state_dict, strict, optional)
        return _IncompatibleKeys(missing, unexpected)

    # --- printing --------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + repr(m).replace("\n", "\n  ")
                 for name, m in self._modules.items() if m is not None]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"


module_calls = threading.local()  # per thread: how deep in nested Module calls we are


def _save_running_stats(module: "Module") -> list:
    saved = []
    for m in module.modules():
        if isinstance(m, BatchNormBase) and m.training and m.track_running_stats:
            saved.append([(b, b.copy()) for b in
                          (m.running_mean, m.running_var, m.num_batches_tracked)])
    return saved


def _restore_running_stats(saved: list) -> None:
    for copies in saved:
        for b, c in copies:
            _core.copy(b._t, c._t)
            b._t.bump_version()


def _move_tensor(t: Tensor, device: Device) -> None:
    """Moves ``t`` (and its gradient) to ``device`` keeping the Python object."""
    if t.device != device:
        t._t = _core.to_device(t._t, device)
    if t.grad is not None and t.grad.device != device:
        t.grad = Tensor(_core.to_device(t.grad._t, device))


class Sequential(Module):
    """Modules applied in order: ``Sequential(m1, m2, ...)`` or ``Sequential(OrderedDict)``."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], Mapping):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def add_module(self, name: str, module: Optional[Module]) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"Sequential: entry '{name}' is a {type(module).__name__}; every "
                            "entry must be an mgpu.nn.Module (wrap functions in a Module)")
        super().add_module(name, module)

    def append(self, module: Module) -> "Sequential":
        self.add_module(str(len(self._modules)), module)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __getitem__(self, idx):
        items = list(self._modules.items())
        if isinstance(idx, slice):
            return Sequential(OrderedDict(items[idx]))
        if not isinstance(idx, numbers.Integral):
            raise TypeError(f"Sequential indices must be integers or slices, got "
                            f"{type(idx).__name__}")
        n = len(items)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for a Sequential of {n} modules")
        return items[idx][1]

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


def _fan_in_out(shape: Tuple[int, ...]) -> Tuple[int, int]:
    if len(shape) < 2:
        raise ValueError(f"fan in and fan out need a tensor with at least 2 dims, got shape "
                         f"{shape}")
    receptive = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


class _Init:
    """``mgpu.nn.init``: in-place initialisers drawn with mgpu.random (NumPy, seedable), so a
    seed gives the same values on every device."""

    @staticmethod
    def _fill_from(t: Tensor, values: np.ndarray) -> Tensor:
        _core.copy(t._t, array(values.reshape(t.shape), device=t.device, dtype=t.dtype)._t)
        t._t.bump_version()
        return t

    @staticmethod
    def _check(t, name: str) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"nn.init.{name}: expected an mgpu tensor (e.g. module.weight), got "
                            f"{type(t).__name__}")

    def normal_(self, tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
        """Fills ``tensor`` with N(mean, std^2) samples."""
        self._check(tensor, "normal_")
        return self._fill_from(tensor, _random.generator().normal(mean, std, size=tensor.shape))

    def uniform_(self, tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
        """Fills ``tensor`` with U[a, b) samples."""
        self._check(tensor, "uniform_")
        return self._fill_from(tensor, _random.generator().uniform(a, b, size=tensor.shape))

    def constant_(self, tensor: Tensor, val: float) -> Tensor:
        self._check(tensor, "constant_")
        return tensor.fill_(float(val))

    def zeros_(self, tensor: Tensor) -> Tensor:
        return self.constant_(tensor, 0.0)

    def ones_(self, tensor: Tensor) -> Tensor:
        return self.constant_(tensor, 1.0)

    def xavier_uniform_(self, tensor: Tensor, gain: float = 1.0) -> Tensor:
        """U[-a, a] with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio)."""
        self._check(tensor, "xavier_uniform_")
        fan_in, fan_out = _fan_in_out(tensor.shape)
        a = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return self.uniform_(tensor, -a, a)

    def kaiming_uniform_(self, tensor: Tensor, a: float = 0.0) -> Tensor:
        """U[-b, b] with b = sqrt(2 / (1 + a^2)) * sqrt(3 / fan_in) (He et al., leaky-ReLU gain)."""
        self._check(tensor, "kaiming_uniform_")
        fan_in, _ = _fan_in_out(tensor.shape)
        bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / fan_in)
        return self.uniform_(tensor, -bound, bound)


init = _Init()


def _default_init(weight: Parameter, bias: Optional[Parameter]) -> None:
    # PyTorch's default for Linear and Conv2d: kaiming_uniform_(a=sqrt(5)), i.e.
    # U[-1/sqrt(fan_in), 1/sqrt(fan_in)], and the bias from the same range.
    init.kaiming_uniform_(weight, a=math.sqrt(5.0))
    if bias is not None:
        fan_in, _ = _fan_in_out(weight.shape)
        bound = 1.0 / math.sqrt(fan_in)
        init.uniform_(bias, -bound, bound)


def _empty_param(shape, device) -> Parameter:
    return Parameter(zeros(shape, device=as_device(device) if device is not None else None))


def _add_weight_and_bias(module: Module, weight_shape: tuple, bias: bool, device) -> None:
    """Linear's and Conv2d's parameters: ``weight`` of ``weight_shape``, ``bias`` of one value per
    output (its first axis) or None, both drawn by PyTorch's default initialisation."""
    module.weight = _empty_param(weight_shape, device)
    if bias:
        module.bias = _empty_param(weight_shape[:1], device)
    else:
        module.register_parameter("bias", None)
    _default_init(module.weight, module.bias)


def check_input(x, what: str) -> Tensor:
    if isinstance(x, np.ndarray):
        raise TypeError(f"{what}: got a NumPy array; convert it with mgpu.array(x, device=...) on "
                        "the module's device first")
    if not isinstance(x, Tensor):
        raise TypeError(f"{what}: expected an mgpu tensor, got {type(x).__name__}")
    return x


def _check_width(module: "Module", name: str, x, ndim: int, width: int) -> Tensor:
    """Linear's and Conv2d's input check: an mgpu tensor of ``ndim`` dims whose axis 1 holds
    ``width`` features or channels (ValueError naming the module and the shape it expects)."""
    x = check_input(x, name)
    if x.ndim != ndim or x.shape[1] != width:
        rest = ", H, W" if ndim == 4 else ""
        raise ValueError(f"{name}({module.extra_repr()}): expected input (N, {width}{rest}), got "
                         f"shape {x.shape}")
    return x


def _positive_int(v, name: str, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{what}: {name} must be a positive int, got {v!r}")
    return int(v)


class Conv2d(Module):
    """2-D convolution: (N, in_channels, H, W) -> (N, out_channels, P, Q); weight (K, C, R, S)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntPair,
                 stride: IntPair = 1, padding: IntPair = 0, bias: bool = True, device=None):
        super().__init__()
        self.in_channels = _positive_int(in_channels, "in_channels", "Conv2d")
        self.out_channels = _positive_int(out_channels, "out_channels", "Conv2d")
        self.kernel_size = functional.as_pair(kernel_size, "kernel_size")
        self.stride = functional.as_square(stride, "stride", "Conv2d")
        self.padding = functional.as_square(padding, "padding", "Conv2d")
        if min(self.kernel_size) < 1 or self.stride < 1 or self.padding < 0:
            raise ValueError(f"Conv2d: kernel_size and stride must be >= 1 and padding >= 0, got "
                             f"kernel_size={kernel_size}, stride={stride}, padding={padding}")
        _add_weight_and_bias(self, (self.out_channels, self.in_channels) + self.kernel_size, bias,
                             device)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")

    def forward(self, x: Tensor) -> Tensor:
        x = _check_width(self, "Conv2d", x, 4, self.in_channels)
        h, w = x.shape[2] + 2 * self.padding, x.shape[3] + 2 * self.padding
        if h < self.kernel_size[0] or w < self.kernel_size[1]:
            raise ValueError(f"Conv2d({self.extra_repr()}): input {x.shape[2]}x{x.shape[3]} "
                             f"(padded {h}x{w}) is smaller than the kernel {self.kernel_size}; "
                             "the input is too small for this network")
        return functional.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class Linear(Module):
    """y = x W^T + b: x (N, in_features) -> (N, out_features); weight (out, in) like PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features = _positive_int(in_features, "in_features", "Linear")
        self.out_features = _positive_int(out_features, "out_features", "Linear")
        _add_weight_and_bias(self, (self.out_features, self.in_features), bias, device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")

    def forward(self, x: Tensor) -> Tensor:
        x = _check_width(self, "Linear", x, 2, self.in_features)
        return functional.linear(x, self.weight, self.bias)


class ReLU(Module):
    """max(x, 0), elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return functional.relu(check_input(x, "ReLU"))


class Flatten(Module):
    """(N, ...) -> (N, product of the rest) (PyTorch's default start_dim=1)."""

    def forward(self, x: Tensor) -> Tensor:
        x = check_input(x, "Flatten")
        if x.ndim < 1:
            raise ValueError("Flatten: expected a tensor with a batch axis, got a 0-d tensor")
        return x.reshape(x.shape[0], -1)


class AvgPool2d(Module):
    """Average pooling without padding: (N, C, H, W) -> (N, C, P, Q)."""

    def __init__(self, kernel_size: IntPair, stride: Optional[IntPair] = None):
        super().__init__()
        self.kernel_size = functional.as_pair(kernel_size, "kernel_size")
        self.stride = functional.as_pair(stride, "stride") if stride is not None \
            else self.kernel_size

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}"

    def forward(self, x: Tensor) -> Tensor:
        x = check_input(x, "AvgPool2d")
        if x.ndim != 4 or x.shape[2] < self.kernel_size[0] or x.shape[3] < self.kernel_size[1]:
            raise ValueError(f"AvgPool2d({self.extra_repr()}): expected (N, C, H, W) at least as "
                             f"large as the kernel, got shape {x.shape}")
        return functional.avg_pool2d(x, self.kernel_size, self.stride)


class MaxPool2d(Module):
    """Max pooling (PyTorch's ``nn.MaxPool2d``): (N, C, H, W) -> (N, C, P, Q), implicit -inf
    padding of at most half the kernel, floor output size; see ``mgpu.ops.max_pool2d``."""

    def __init__(self, kernel_size: IntPair, stride: Optional[IntPair] = None,
                 padding: IntPair = 0, dilation: IntPair = 1, return_indices: bool = False,
                 ceil_mode: bool = False):
        super().__init__()
        op = "MaxPool2d"
        self.kernel_size = functional.int_pair(kernel_size, "kernel_size", op)
        self.stride = functional.int_pair(stride, "stride", op) if stride is not None \
            else self.kernel_size
        self.padding = functional.int_pair(padding, "padding", op)
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0 or 2 * ph > kh or 2 * pw > kw:
            raise ValueError(f"MaxPool2d: kernel_size and stride must be >= 1 and padding >= 0 "
                             f"and at most half the kernel, got kernel_size={kernel_size}, "
                             f"stride={stride}, padding={padding}")
        if functional.int_pair(dilation, "dilation", op) != (1, 1) or return_indices \
                or ceil_mode:
            raise ValueError("MaxPool2d: only dilation=1, return_indices=False and "
                             "ceil_mode=False are supported")
        self.dilation, self.return_indices, self.ceil_mode = 1, False, False

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}")

    def forward(self, x: Tensor) -> Tensor:
        x = check_input(x, "MaxPool2d")
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        if x.ndim != 4 or x.shape[2] + 2 * ph < kh or x.shape[3] + 2 * pw < kw:
            raise ValueError(f"MaxPool2d({self.extra_repr()}): expected (N, C, H, W) at least as "
                             f"large as the kernel once padded, got shape {x.shape}")
        return functional.max_pool2d(x, self.kernel_size, self.stride, self.padding)


class Dropout(Module):
    """PyTorch's ``nn.Dropout(p)``: in training mode zeroes each element with probability p and
    scales the rest by 1 / (1 - p) (computed in float32, as PyTorch); in evaluation mode
    (``net.eval()``, and the fused ``evaluate_step``) the identity; p = 0 is always the identity
    and p = 1 gives zeros. Backward multiplies dy by the forward's mask.

    The masks depend on the loop:

    - the book's loop (calling the module, ``ops.dropout``): each call draws a fresh mask for
      the whole tensor it is given from ``mgpu.random``'s PCG64 generator (NumPy's
      ``random()`` >= p), so a mask depends on the generator's state and on the tensor's shape;
      under ``nn.DataParallel`` each replica draws for its own shard, in device order.
      ``mgpu.random.seed(n)`` repeats them.
    - the fused step (``DataParallel.train_step``, ``chapter.train_concise(fused=True)``):
      element e of the example at row r of the step's whole batch X is kept iff
      u >= p, u = Philox-4x32-10(counter (e // 4, r, layer, 0), key (seed % 2**32,
      seed // 2**32))[e % 4] / 2**32 (``mgpu._core.dropout_forward``), with ``layer`` this
      module's index in the fused model's layer list and ``seed`` drawn from ``mgpu.random``
      once per step. So an example's mask does not depend on the device, rank or micro-batch
      that computes it: the same on any device count, under mpirun and with ``accumulate``;
      ``mgpu.random.seed`` repeats them, and a run resumed from a checkpoint (which saves the
      generator's state) draws the seeds an uninterrupted run draws. Backward recomputes the
      mask from the same counters."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        if inplace:
            raise ValueError("Dropout: inplace=True is not supported; use inplace=False")
        self.p = float(p)
        self.inplace = False

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: Tensor) -> Tensor:
        return functional.dropout(check_input(x, "Dropout"), self.p, self.training)


class AdaptiveAvgPool2d(Module):
    """Global average pooling: (N, C, H, W) -> (N, C, 1, 1). Only output size (1, 1) is
    supported (what ResNet uses)."""

    def __init__(self, output_size: IntPair):
        super().__init__()
        size = functional.as_pair(output_size, "output_size")
        if size != (1, 1):
            raise ValueError(f"AdaptiveAvgPool2d: only output_size (1, 1) (global average "
                             f"pooling) is supported, got {output_size!r}")
        self.output_size = size

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"

    def forward(self, x: Tensor) -> Tensor:
        x = check_input(x, "AdaptiveAvgPool2d")
        if x.ndim != 4:
            raise ValueError(f"AdaptiveAvgPool2d: expected (N, C, H, W), got shape {x.shape}")
        return functional.avg_pool2d(x, (x.shape[2], x.shape[3]))


class BatchNormBase(Module):
    """Batch normalisation over N, H, W per channel, PyTorch's semantics and defaults.

    In training the output uses the batch's statistics and the running ones are updated in
    place (mean and unbiased variance, weight ``momentum``; ``momentum=None`` is a cumulative
    average); in evaluation the running statistics are used. ``track_running_stats=False``
    always uses batch statistics and keeps none.
    """

    _dims = (4,)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None):
        super().__init__()
        self.num_features = _positive_int(num_features, "num_features", type(self).__name__)
        if not eps > 0:
            raise ValueError(f"{type(self).__name__}: eps must be > 0, got {eps}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{type(self).__name__}: momentum must be in [0, 1] or None, got "
                             f"{momentum}")
        self.eps, self.momentum = float(eps), momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        dev = as_device(device) if device is not None else None
        if self.affine:
            self.weight = Parameter(ones((self.num_features,), device=dev))
            self.bias = Parameter(zeros((self.num_features,), device=dev))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if self.track_running_stats:
            self.register_buffer("running_mean", zeros((self.num_features,), device=dev))
            self.register_buffer("running_var", ones((self.num_features,), device=dev))
            self.register_buffer("num_batches_tracked", zeros((), device=dev, dtype=np.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1.0)
            self.num_batches_tracked.zero_()

    def _check(self, x) -> Tensor:
        name = type(self).__name__
        x = check_input(x, name)
        if x.ndim not in self._dims or x.shape[1] != self.num_features:
            want = " or ".join(f"{d}-d" for d in self._dims)
            raise ValueError(f"{name}({self.num_features}): expected a {want} input with "
                             f"{self.num_features} channels on axis 1, got shape {x.shape}")
        return x

    def _momentum_now(self) -> float:
        """Counts this training batch and returns the running-statistics weight to use."""
        t = self.num_batches_tracked
        # int64 has no arithmetic on devices: count in float32 (exact below 2^24 batches) and
        # store back, all queued, so counting never waits for the device.
        counted = _core.binary_scalar(_core.BinaryOp.Add, _core.astype(t._t, "float32"), 1.0, False)
        _core.copy(t._t, _core.astype(counted, "int64"))
        t._t.bump_version()
        if self.momentum is None:  # a cumulative average needs the count on the host
            return 1.0 / int(t.item())
        return float(self.momentum)

    def forward(self, x: Tensor) -> Tensor:
        x = self._check(x)
        use_batch = self.training or not self.track_running_stats
        count = x.size // self.num_features
        if use_batch and count <= 1:
            raise ValueError(f"{type(self).__name__}: training needs more than one value per "
                             f"channel, got input shape {x.shape}; use a larger batch or eval()")
        momentum = 0.0
        if self.training and self.track_running_stats:
            momentum = self._momentum_now()
        return functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,
            training=use_batch, momentum=momentum, eps=self.eps)


class BatchNorm2d(BatchNormBase):
    """Batch normalisation of (N, C, H, W) inputs, statistics per channel over N, H, W."""


class BatchNorm1d(BatchNormBase):
    """Batch normalisation of (N, C) inputs, statistics per feature over N."""

    _dims = (2,)


# --- losses ----------------------------------------------------------------------------------

class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits (N, M) against labels (N,).

    ``reduction`` is PyTorch's: 'mean' (the default, as ``nn.CrossEntropyLoss()`` in sec. 12.6),
    'sum', or 'none' (per-example losses, which sec. 12.5 asks for explicitly).
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        self.reduction = reduction

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"

    def forward(self, y_hat: Tensor, y: Tensor) -> Tensor:
        y_hat = check_input(y_hat, f"{type(self).__name__} (logits)")
        y = check_input(y, f"{type(self).__name__} (labels)")
        losses = cross_entropy(y_hat, y)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            return losses.mean()
        return losses


class SoftmaxCrossEntropyLoss(CrossEntropyLoss):
    """Gluon's name; like Gluon's it returns per-example losses unless told otherwise."""

    def __init__(self, reduction: str = "none"):
        super().__init__(reduction)


# DataParallel and SyncBatchNorm build on Module: mgpu.data_parallel, a floor above, adds them here.
from . import nn_utils as utils  # noqa: E402  (mgpu.nn.utils: clip_grad_norm_)

sys.modules[__name__ + ".utils"] = utils  # so that `from mgpu.nn.utils import ...` works

__all__ = ["Module", "Parameter", "Sequential", "Conv2d", "Linear", "ReLU", "Flatten",
           "AvgPool2d", "MaxPool2d", "Dropout", "AdaptiveAvgPool2d", "BatchNorm1d",
           "BatchNorm2d", "CrossEntropyLoss", "SoftmaxCrossEntropyLoss", "init", "functional"]
