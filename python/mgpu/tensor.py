"""mgpu's tensor: a contiguous array on a device, with the autograd fields the chapter uses.

Just what the chapter's code needs: ``shape``, ``dtype``, ``device``, ``reshape``, ``.to(device)`` /
``copyto``, ``t[:] = u``, ``t[:] += u``, ``+ - * /`` (equal shapes, a bias broadcast over rows, or
scalars), ``.sum()``, ``.grad``, ``requires_grad_()`` / ``attach_grad()``, ``zero_()``; NumPy and
DLPack in and out. Work is asynchronous: an op returns at once and the host waits only in
``numpy()``, ``item()``, ``repr()`` and ``mgpu.waitall()``.

Element types: float32 (what ops compute on), int32 and int64 (labels), uint8 (raw images), and
``mgpu.bfloat16``, which holds data -- a model's weights or activations crossing to and from
PyTorch (DLPack) or a checkpoint -- in half the bytes. ``astype(mgpu.bfloat16)`` (or
``mgpu.array(x, dtype=mgpu.bfloat16)``) rounds float32 to nearest, ties to even, keeping
denormals, infinities and NaNs (cpp/core/dtype.h; other data goes through float32 first, as in
PyTorch and ml_dtypes); ``astype(mgpu.float32)`` widens exactly. Ops take float32 tensors: a
bfloat16 one is a TypeError saying to convert it, or to compute in bfloat16 on float32 tensors
under ``mgpu.autocast("bf16")``. NumPy has no bfloat16 of its own: where the ``ml_dtypes``
package is installed (``pip install mgpu[bfloat16]``), ``mgpu.bfloat16`` is its dtype and
``numpy()`` gives an ``ml_dtypes.bfloat16`` array; without it, ``mgpu.bfloat16`` is mgpu's own
marker and ``numpy()`` gives the exact values as float32. Either way ``t.bits()`` gives the raw
bits (uint16) and :func:`bfloat16_from_bits` makes a tensor of them. ml_dtypes is optional: the
engine keeps raw bits, DLPack (PyTorch, JAX) and checkpoints carry them, and only what
``numpy()`` returns depends on it, so a plain install stays NumPy-only.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import numpy as np

from . import amp, autograd
from .device import Device, as_device, cpu
from .engine import core as _core

try:  # optional: NumPy's bfloat16 dtype (JAX's); without it numpy() gives float32 values
    import ml_dtypes as _ml_dtypes
except ImportError:
    _ml_dtypes = None

Shape = Tuple[int, ...]
_Op = _core.BinaryOp


class _BFloat16:
    """``mgpu.bfloat16`` where ml_dtypes is not installed: the dtype of bfloat16 tensors, equal
    to itself and to the name ``"bfloat16"``."""

    name = "bfloat16"
    itemsize = 2

    def __repr__(self) -> str:
        return "mgpu.bfloat16"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        return other is self or (isinstance(other, str) and other == self.name)

    def __hash__(self) -> int:
        return hash(self.name)


bfloat16 = np.dtype(_ml_dtypes.bfloat16) if _ml_dtypes is not None else _BFloat16()
float32 = np.dtype(np.float32)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint8 = np.dtype(np.uint8)
_NAMES = ("float32", "bfloat16", "int32", "int64", "uint8")


def dtype_name(dtype, op: str = "dtype") -> str:
    """The name of an element type mgpu holds ("float32", "bfloat16", ...) from a NumPy dtype,
    a NumPy or ml_dtypes scalar type, ``mgpu.bfloat16`` or a name; a TypeError otherwise."""
    if isinstance(dtype, (str, _BFloat16)):
        name = str(dtype)
    else:
        try:
            name = np.dtype(dtype).name if dtype is not None else "None"
        except TypeError:
            name = str(dtype)
    if name not in _NAMES:
        raise TypeError(f"{op}: unsupported dtype {name}; mgpu tensors hold float32, bfloat16, "
                        "int32, int64 or uint8")
    return name


def _is_dtype(x) -> bool:
    try:
        dtype_name(x)
    except TypeError:
        return False
    return True


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as NumPy sees them: an ml_dtypes.bfloat16 view, or exact float32."""
    if _ml_dtypes is not None:
        return bits.view(_ml_dtypes.bfloat16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def engine_handle(x, op: str, arg: str) -> "_core.Tensor":
    """The engine handle of tensor ``x``; a TypeError naming ``op`` and ``arg`` otherwise."""
    if isinstance(x, Tensor):
        return x._t
    hint = (" (convert it with mgpu.array(...))" if isinstance(x, (np.ndarray, list, tuple,
                                                                   numbers.Number)) else "")
    raise TypeError(f"{op}: {arg} must be an mgpu tensor, got {type(x).__name__}{hint}")


def check_int(v, op: str, what: str) -> int:
    """``v`` as a Python int; a TypeError for floats, bools and other non-integers (never
    truncated)."""
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
        raise TypeError(f"{op}: {what} must be an integer, got {v!r} ({type(v).__name__})")
    return int(v)


def check_nonnegative(v, op: str, what: str) -> float:
    """``v`` as a float; a TypeError unless it is a real number (bools refused), a ValueError
    unless it is finite and >= 0. The rule for hyperparameters such as the learning rate,
    momentum and weight decay, wherever they enter (the optimizers' groups, the fused step)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{op}: {what} must be a number, got {type(v).__name__}")
    try:
        x = float(v)
    except OverflowError:  # an int beyond float's range
        x = math.inf
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{op}: {what} must be a finite number >= 0.0, got {v}")
    return x


def _shape(shape, op: str = "shape") -> list:
    """A shape argument (an int or a sequence of ints) as a list; floats are refused, not cut."""
    if isinstance(shape, (numbers.Integral, np.integer)) and not isinstance(shape, bool):
        return [int(shape)]
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{op}: the shape must be an int or a tuple of ints, got {shape!r}")
    return [check_int(s, op, f"every extent of the shape {tuple(shape)!r}") for s in shape]


class Tensor:
    """A tensor on a device. Create one with :func:`array`, :func:`zeros`, :func:`ones` ..."""

    __slots__ = ("_t", "grad", "requires_grad", "_node", "__weakref__")
    __array_priority__ = 1000  # so ndarray (op) Tensor defers to Tensor's reflected operators

    def __init__(self, handle: "_core.Tensor", requires_grad: bool = False):
        self._t = handle
        self.grad: Optional[Tensor] = None
        self.requires_grad = requires_grad
        self._node = None

    # --- description ---------------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        return self._t.shape

    @property
    def dtype(self) -> np.dtype:
        """A NumPy dtype, or ``mgpu.bfloat16`` for a bfloat16 tensor."""
        name = self._t.dtype
        return bfloat16 if name == "bfloat16" else np.dtype(name)

    @property
    def device(self) -> Device:
        return self._t.device

    ctx = device  # MXNet's name, used by the chapter's allreduce

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # --- host access ---------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A NumPy copy of the values (waits for the device). A bfloat16 tensor gives an
        ml_dtypes.bfloat16 array where ml_dtypes is installed, else its exact float32 values."""
        a = self._t.numpy()
        return _bf16_values(a) if self._t.dtype == "bfloat16" else a

    def bits(self) -> np.ndarray:
        """The raw bits of a bfloat16 tensor, as a uint16 NumPy array (waits for the device);
        :func:`bfloat16_from_bits` makes a tensor of them."""
        if self._t.dtype != "bfloat16":
            raise TypeError(f"bits(): only a bfloat16 tensor gives its raw bits, this one is "
                            f"{self._t.dtype} (use numpy())")
        return self._t.numpy()

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def item(self) -> Union[float, int]:
        """The value of a one-element tensor as a Python number (waits for the device)."""
        if self.size != 1:
            raise ValueError(f"item(): the tensor has {self.size} elements (shape {self.shape}); "
                             "only a one-element tensor converts to a Python number")
        return self.numpy().reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __repr__(self) -> str:
        return f"{np.array2string(self.numpy(), separator=' ')} @{self.device}"

    __str__ = __repr__

    # --- DLPack --------------------------------------------------------------------------
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        on_gpu = self.device.kind == _core.DeviceKind.CUDA
        wants_host = dl_device is not None and tuple(dl_device)[0] == 1
        if dl_device is not None and not wants_host and \
                tuple(int(v) for v in dl_device) != self.__dlpack_device__():
            # The protocol: a device the producer cannot export to is refused, not ignored.
            raise BufferError(f"__dlpack__: a tensor on {self.device} cannot be exported to "
                              f"DLPack device {tuple(dl_device)}; only to "
                              f"{self.__dlpack_device__()} or the CPU")
        if copy or (on_gpu and wants_host):
            if copy is False:
                raise BufferError(f"__dlpack__: a tensor on {self.device} cannot be shared with "
                                  "the CPU without a copy; pass copy=True or use .numpy()")
            if self._t.dtype == "bfloat16":  # NumPy cannot export bfloat16: a host copy of ours
                return _core.to_device(self._t, cpu(0), True).to_dlpack()
            return self._t.numpy().__dlpack__()
        return self._t.to_dlpack()  # waits for the device first, so any stream may read it

    def __dlpack_device__(self) -> Tuple[int, int]:
        if self.device.kind == _core.DeviceKind.CUDA:
            return (2, self.device.index)  # kDLCUDA
        return (1, 0)  # kDLCPU

    # --- autograd ------------------------------------------------------------------------
    def requires_grad_(self, requires_grad: bool = True) -> "Tensor":
        """Marks this tensor as a parameter whose gradient backward() computes (PyTorch style)."""
        self._check_float("requires_grad_")
        self.requires_grad = requires_grad
        return self

    def attach_grad(self) -> "Tensor":
        """Requires grad and allocates ``.grad`` as zeros (MXNet style)."""
        self.requires_grad_()
        self.grad = zeros(self.shape, device=self.device)
        self._node = None
        return self

    def backward(self, grad: Optional["Tensor"] = None) -> None:
        """Adds d(self)/d(leaf) into every leaf's ``.grad``; a non-scalar propagates its sum."""
        if not self.requires_grad:
            raise RuntimeError("backward: this tensor does not require grad; call requires_grad_() "
                               "or attach_grad() on the parameters before computing it")
        if grad is not None:
            if not isinstance(grad, Tensor):
                raise TypeError(f"backward: grad must be an mgpu tensor, got {type(grad).__name__}")
            if grad.shape != self.shape or grad.device != self.device:
                raise ValueError(f"backward: grad has shape {grad.shape} on {grad.device} but the "
                                 f"tensor has shape {self.shape} on {self.device}; they must match")
        autograd.backward(self, grad if grad is not None else ones_like(self))

    def detach(self) -> "Tensor":
        """The same values, cut from the graph (shares memory)."""
        return Tensor(self._t)

    def _check_float(self, what: str) -> None:
        if self._t.dtype != "float32":
            fix = (" (convert it with .astype(mgpu.float32), or compute in bfloat16 on float32 "
                   "tensors under mgpu.autocast('bf16'))" if self._t.dtype == "bfloat16" else "")
            raise TypeError(f"{what}: only float32 tensors take part in autograd, "
                            f"this one is {self._t.dtype}{fix}")

    # --- moving and copying --------------------------------------------------------------
    def to(self, device) -> "Tensor":
        """This tensor on ``device`` (itself if it is already there), recorded for autograd; or,
        given a dtype (``t.to(mgpu.bfloat16)``), :meth:`astype`."""
        if not isinstance(device, Device) and _is_dtype(device):
            return self.astype(device)
        device = as_device(device)
        if device == self.device:
            return self
        out = Tensor(_core.to_device(self._t, device))
        src_device = self.device
        return autograd.attach(out, [self], lambda dy: (dy.to(src_device),), saved=(), op="to")

    def copyto(self, other) -> "Tensor":
        """MXNet's copyto: a new copy on a device, or copies into an existing tensor."""
        if isinstance(other, Tensor):
            if other.shape != self.shape:
                raise ValueError(f"copyto: the target has shape {other.shape} but this tensor has "
                                 f"shape {self.shape}; reshape one of them first")
            _core.copy(other._t, self._t)
            other._t.bump_version()
            return other
        if other is None or isinstance(other, (np.ndarray, numbers.Number)):
            raise TypeError(f"copyto: the target must be a device or an mgpu tensor, got "
                            f"{type(other).__name__}")
        return Tensor(_core.to_device(self._t, as_device(other), True))

    def copy(self) -> "Tensor":
        return self.copyto(self.device)

    def astype(self, dtype) -> "Tensor":
        """A converted copy (itself if it already has ``dtype``): to bfloat16 rounded to nearest,
        ties to even; from bfloat16 exact. Not recorded for autograd."""
        name = dtype_name(dtype, "astype")
        if name == self._t.dtype:
            return self
        return Tensor(_core.astype(self._t, name))

    def reshape(self, *shape) -> "Tensor":
        """A view with a new shape; one extent may be -1."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        old = self.shape
        out = Tensor(self._t.reshape(_shape(shape, "reshape")))
        return autograd.attach(out, [self], lambda dy: (dy.reshape(old),), saved=(),
                               op="reshape")

    # --- in place ------------------------------------------------------------------------
    def zero_(self) -> "Tensor":
        _core.fill(self._t, 0.0)
        self._t.bump_version()
        return self

    def fill_(self, value: float) -> "Tensor":
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number)):
            raise TypeError(f"fill_: value must be a number, got {type(value).__name__}")
        _core.fill(self._t, float(value))
        self._t.bump_version()
        return self

    def __getitem__(self, key) -> "Tensor":
        begin, end = self._rows(key)
        out = Tensor(self._t.slice_rows(begin, end))
        if isinstance(key, numbers.Integral):
            out = Tensor(out._t.reshape(list(self.shape[1:])))
        return out

    def __setitem__(self, key, value) -> None:
        begin, end = self._rows(key)
        target = self._t if (begin, end) == (0, self.shape[0] if self.shape else 1) \
            else self._t.slice_rows(begin, end)
        if isinstance(value, Tensor):
            if value._t.same_memory(target):
                return  # t[:] += u already wrote into t itself (and bumped its version)
            want = self.shape[1:] if isinstance(key, numbers.Integral) else tuple(target.shape)
            if value.shape != want and value.shape != tuple(target.shape):
                raise ValueError(f"cannot assign a tensor of shape {value.shape} to a selection "
                                 f"of shape {want}; shapes must match (reshape the value first)")
            _core.copy(target, value._t)  # a memmove on one device: overlap is safe
        elif isinstance(value, numbers.Number) and not isinstance(value, bool):
            _core.fill(target, float(value))
        elif value is None:
            raise TypeError("cannot assign None to a tensor selection; assign a tensor, an array "
                            "or a number")
        else:
            src = array(value, device=self.device, dtype=self.dtype)
            _core.copy(target, src._t)
        self._t.bump_version()

    def _rows(self, key) -> Tuple[int, int]:
        """Rows [begin, end) selected by ``:``, an integer, or a step-1 slice along axis 0."""
        if not self.shape:
            if key == slice(None) or key is Ellipsis:
                return 0, 1
            raise IndexError("a 0-d tensor can only be indexed with [:]")
        n = self.shape[0]
        if isinstance(key, numbers.Integral):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {key} is out of range for axis 0 of size {n}")
            return i, i + 1
        if key is Ellipsis:
            return 0, n
        if isinstance(key, slice):
            begin, end, step = key.indices(n)
            if step != 1:
                raise IndexError("mgpu tensors support only step-1 slices along axis 0")
            return begin, max(begin, end)
        raise IndexError(f"unsupported index {key!r}: use t[:], t[i] or t[a:b] (axis 0)")

    # --- arithmetic ----------------------------------------------------------------------
    def _binary(self, other, op: "_core.BinaryOp", reverse: bool = False) -> "Tensor":
        if isinstance(other, numbers.Number) and not isinstance(other, bool):
            return _scalar_op(self, float(other), op, reverse)
        if not isinstance(other, Tensor):
            if isinstance(other, np.ndarray) or isinstance(other, (list, tuple)):
                other = array(other, device=self.device)
            else:
                return NotImplemented
        a, b = (other, self) if reverse else (self, other)
        return _tensor_op(a, b, op)

    def __add__(self, o): return self._binary(o, _Op.Add)
    def __radd__(self, o): return self._binary(o, _Op.Add, True)
    def __sub__(self, o): return self._binary(o, _Op.Sub)
    def __rsub__(self, o): return self._binary(o, _Op.Sub, True)
    def __mul__(self, o): return self._binary(o, _Op.Mul)
    def __rmul__(self, o): return self._binary(o, _Op.Mul, True)
    def __truediv__(self, o): return self._binary(o, _Op.Div)
    def __rtruediv__(self, o): return self._binary(o, _Op.Div, True)
    def __neg__(self): return self._binary(-1.0, _Op.Mul)

    def _inplace(self, other, op: "_core.BinaryOp") -> "Tensor":
        if isinstance(other, numbers.Number) and not isinstance(other, bool):
            _core.binary_scalar_inplace(op, self._t, float(other))
        elif isinstance(other, Tensor):
            src = other._t
            if src.shares_memory(self._t) and not src.same_memory(self._t):
                # a += a[0], a[1:] += a[:-1]: the op would read elements it already wrote, so
                # it reads a copy, as NumPy does (an exact alias, a += a, reads each element
                # before writing it and needs none).
                src = _core.to_device(src, src.device, True)
            _core.binary_inplace(op, self._t, src)
        elif isinstance(other, (np.ndarray, list, tuple)):
            return self._inplace(array(other, device=self.device, dtype=self.dtype), op)
        else:
            return NotImplemented
        self._t.bump_version()
        return self

    def __iadd__(self, o): return self._inplace(o, _Op.Add)
    def __isub__(self, o): return self._inplace(o, _Op.Sub)
    def __imul__(self, o): return self._inplace(o, _Op.Mul)
    def __itruediv__(self, o): return self._inplace(o, _Op.Div)

    def sum(self) -> "Tensor":
        """The sum of all elements, a 0-d tensor."""
        self._check_float("sum")
        out = Tensor(_core.sum(self._t))
        shape, device = self.shape, self.device
        return autograd.attach(out, [self],
                               lambda dy: (_tensor_op(ones(shape, device=device), dy, _Op.Mul),),
                               saved=(), op="sum")

    def mean(self) -> "Tensor":
        return self.sum() / max(1, self.size)

    def argmax(self, axis: int = -1) -> "Tensor":
        return argmax(self, axis)

    def __matmul__(self, other: "Tensor") -> "Tensor":
        return mm(self, other)

    # Elementwise equality of labels is not a tensor op here: compare with numpy() or use
    # mgpu.evaluate_accuracy. Identity semantics keep tensors usable as dict keys.
    __hash__ = object.__hash__


def _unbroadcast(g: Tensor, shape: Shape) -> Tensor:
    return g if g.shape == tuple(shape) else Tensor(_core.sum_to_shape(g._t, list(shape)))


def _tensor_op(a: Tensor, b: Tensor, op: "_core.BinaryOp") -> Tensor:
    out = Tensor(_core.binary(op, a._t, b._t))
    if not (autograd.is_recording() and (a.requires_grad or b.requires_grad)):
        return out
    sa, sb = a.shape, b.shape

    def backward(dy):
        if op == _Op.Add:
            return _unbroadcast(dy, sa), _unbroadcast(dy, sb)
        if op == _Op.Sub:
            return _unbroadcast(dy, sa), _unbroadcast(-dy, sb)
        if op == _Op.Mul:
            return _unbroadcast(dy * b.detach(), sa), _unbroadcast(dy * a.detach(), sb)
        bd = b.detach()
        return _unbroadcast(dy / bd, sa), _unbroadcast(-(dy * a.detach()) / (bd * bd), sb)

    names = {_Op.Add: "add", _Op.Sub: "sub", _Op.Mul: "mul", _Op.Div: "div"}
    saved = (a, b) if op in (_Op.Mul, _Op.Div) else ()  # add and sub read neither input
    return autograd.attach(out, [a, b], backward, saved=saved, op=names[op])


def _scalar_op(a: Tensor, s: float, op: "_core.BinaryOp", scalar_first: bool) -> Tensor:
    out = Tensor(_core.binary_scalar(op, a._t, s, scalar_first))

    def backward(dy):
        if op in (_Op.Add,):
            return (dy,)
        if op == _Op.Sub:
            return (-dy if scalar_first else dy,)
        if op == _Op.Mul:
            return (dy * s,)
        if scalar_first:  # d(s / a) = -s / a^2
            ad = a.detach()
            return ((dy * -s) / (ad * ad),)
        return (dy / s,)

    reads_a = op == _Op.Div and scalar_first  # d(s / a) reads a
    return autograd.attach(out, [a], backward, saved=(a,) if reads_a else (),
                           op=f"scalar {str(op).split('.')[-1].lower()}")


# --- construction --------------------------------------------------------------------------

_DTYPES = {np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint8)}
_BF16_FIX = ("mgpu's ops compute on float32 tensors: convert it with .astype(mgpu.float32), or "
             "keep float32 tensors and run the op under mgpu.autocast('bf16') (bfloat16 "
             "products, float32 sums)")


# --- mm and argmax: Tensor's ``@`` and ``argmax`` call them, so they live on this floor; mgpu.ops
# exports them with its other ops, which check their inputs with check_tensors --------------------

def needs_grad(t: Optional[Tensor]) -> bool:
    return t is not None and t.requires_grad


def check_tensors(op: str, **named) -> None:
    """Checks that every named argument is an mgpu tensor (or None): a NumPy array or anything
    else is a TypeError saying how to make one, never an AttributeError from inside mgpu."""
    for name, t in named.items():
        if isinstance(t, Tensor) and t._t.dtype == "bfloat16":
            raise TypeError(f"{op}: {name} is a bfloat16 tensor; {_BF16_FIX}")
        if t is None or isinstance(t, Tensor):
            continue
        if isinstance(t, np.ndarray):
            raise TypeError(f"{op}: {name} is a NumPy array; ops take mgpu tensors, make one "
                            f"with mgpu.array({name}, device=...) on the other inputs' device")
        raise TypeError(f"{op}: {name} must be an mgpu tensor, got {type(t).__name__}")


def mm(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product: a (M, K) @ b (K, N) -> (M, N)."""
    check_tensors("mm", a=a, b=b)
    prec = amp.get_precision()  # mgpu.autocast's; backward runs with the forward's
    out = Tensor(_core.mm(a._t, b._t, False, False, prec))

    def backward(dy):
        da = Tensor(_core.mm(dy._t, b._t, False, True, prec)) if needs_grad(a) else None
        db = Tensor(_core.mm(a._t, dy._t, True, False, prec)) if needs_grad(b) else None
        return da, db

    return autograd.attach(out, [a, b], backward)


def argmax(x: Tensor, axis: int = -1) -> Tensor:
    """Index of the largest entry along ``axis`` (the last axis of a 1-d or 2-d tensor)."""
    check_tensors("argmax", x=x)
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"argmax: only the last axis is supported (axis=-1 or {x.ndim - 1}), "
                         f"got axis={axis}")
    return Tensor(_core.argmax(x._t))


def _default_dtype(a: np.ndarray) -> np.dtype:
    if a.dtype in _DTYPES:
        return a.dtype
    if a.dtype.kind == "f":
        return np.dtype(np.float32)
    if a.dtype.kind in "iub":
        return np.dtype(np.int64)
    raise TypeError(f"cannot make an mgpu tensor from {a.dtype} data; "
                    "use float32, int32, int64 or uint8 values")


def array(obj, device: Optional[Device] = None, dtype=None, ctx: Optional[Device] = None) -> Tensor:
    """A tensor copied from a NumPy array, a (nested) list, a number or another tensor.

    Floating data becomes float32 and integer data int64 unless ``dtype`` says otherwise; an
    ml_dtypes.bfloat16 array stays bfloat16. ``dtype=mgpu.bfloat16`` rounds the values (as
    float32) to bfloat16 on the device (see :meth:`Tensor.astype`).
    """
    device = as_device(device or ctx or cpu(0))
    if isinstance(obj, Tensor):
        t = obj.copyto(device)
        return t if dtype is None else t.astype(dtype)
    want = dtype_name(dtype, "array") if dtype is not None else None
    a = np.asarray(obj)
    if a.dtype.name == "bfloat16":  # ml_dtypes' (NumPy itself has none)
        if want in (None, "bfloat16"):
            return bfloat16_from_bits(np.ascontiguousarray(a).view(np.uint16), device)
        a = a.astype(np.float32)  # exact
    if want is None:
        want = _default_dtype(a).name
    if want == "bfloat16":
        f = np.asarray(a, dtype=np.float32, order="C")
        return Tensor(_core.astype(_core.Tensor.from_numpy(f, device), "bfloat16"))
    a = np.asarray(a, dtype=want, order="C")  # keeps 0-d values 0-d
    return Tensor(_core.Tensor.from_numpy(a, device))


def bfloat16_from_bits(bits, device: Optional[Device] = None) -> Tensor:
    """A bfloat16 tensor holding the raw bits ``bits`` (a uint16 array), as :meth:`Tensor.bits`
    gives them: no rounding, NaN payloads kept."""
    a = np.asarray(bits)
    if a.dtype != np.uint16:
        raise TypeError(f"bfloat16_from_bits: bits must be a uint16 array, got {a.dtype}")
    return Tensor(_core.Tensor.from_numpy(np.ascontiguousarray(a), as_device(device or cpu(0)),
                                          True))


def tensor(obj, device: Optional[Device] = None, dtype=None) -> Tensor:
    """PyTorch's name for :func:`array`."""
    return array(obj, device=device, dtype=dtype)


def full(shape, value: float, device: Optional[Device] = None, dtype=np.float32,
         ctx: Optional[Device] = None) -> Tensor:
    """A tensor of ``shape`` filled with ``value``."""
    return _full(shape, value, device or ctx, dtype, "full")


def _full(shape, value, device, dtype, op: str) -> Tensor:
    t = Tensor(_core.Tensor.empty(_shape(shape, op), dtype_name(dtype, op),
                                  as_device(device or cpu(0)), op))
    _core.fill(t._t, float(value))
    return t


def zeros(shape, device: Optional[Device] = None, dtype=np.float32,
          ctx: Optional[Device] = None) -> Tensor:
    """A tensor of zeros."""
    return _full(shape, 0.0, device or ctx, dtype, "zeros")


def ones(shape, device: Optional[Device] = None, dtype=np.float32,
         ctx: Optional[Device] = None) -> Tensor:
    """A tensor of ones."""
    return _full(shape, 1.0, device or ctx, dtype, "ones")


def zeros_like(t: Tensor) -> Tensor:
    return zeros(t.shape, device=t.device, dtype=t.dtype)


def ones_like(t: Tensor) -> Tensor:
    return ones(t.shape, device=t.device, dtype=t.dtype)


def arange(n: int, device: Optional[Device] = None, dtype=np.float32,
           ctx: Optional[Device] = None) -> Tensor:
    """0, 1, ..., n-1 (float32 by default, as MXNet's ``np.arange`` in the chapter)."""
    return array(np.arange(check_int(n, "arange", "n")), device=device or ctx, dtype=dtype)


_DLPACK_CUDA = 2  # kDLCUDA, DLPack's device type of CUDA memory


def from_dlpack(obj) -> Tensor:
    """A tensor sharing memory with any DLPack producer (NumPy array, PyTorch or JAX CPU tensor,
    ...): float32, bfloat16 (DLPack's kDLBfloat, e.g. torch.bfloat16), int32, int64 or uint8,
    contiguous; other element types and strided views are refused with a TypeError /
    ValueError naming the problem. A tensor made from a JAX array
    shares JAX's buffer, which JAX treats as immutable: write to a copy
    (``mgpu.array(np.asarray(x))``)."""
    if hasattr(obj, "__dlpack__"):
        # A producer on one of our GPUs is asked to order its pending work before the stream
        # mgpu reads after (the protocol's `stream`): mgpu's own streams do not wait for its
        # default stream by themselves.
        kwargs = {}
        where = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
        on_gpu = where is not None and int(where[0]) == _DLPACK_CUDA
        if on_gpu and 0 <= int(where[1]) < _core.num_gpus():
            kwargs["stream"] = _core._dlpack_stream(int(where[1]))
        try:
            capsule = obj.__dlpack__(**kwargs)
        except (TypeError, BufferError) as e:
            raise ValueError(f"from_dlpack: the object refused to export: {e}") from e
    elif type(obj).__name__ == "PyCapsule":
        capsule = obj
    else:
        raise TypeError(f"from_dlpack: expected an object with __dlpack__ (a NumPy array, a "
                        f"PyTorch tensor, ...) or a DLPack capsule, got {type(obj).__name__}")
    return Tensor(_core.Tensor.from_dlpack(capsule))

