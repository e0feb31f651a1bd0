"""Weights by name into a module's tensors, with PyTorch's rules (``Module.load_state_dict``).

A state dict from PyTorch loads as it is: mgpu's module names are PyTorch's (d2l's ResNet-18 has
the same keys and shapes in both), and DataParallel's ``module.`` prefix is dropped when every key
carries it and the module's own names do not. Values may be mgpu tensors, NumPy arrays or any
object with ``__dlpack__`` (PyTorch, JAX, CuPy tensors); each is converted to its target's dtype
and device, as PyTorch's ``copy_`` does. ``strict`` is PyTorch's: missing and unexpected keys are
an error with it and are returned either way; a shape mismatch is an error always. A BatchNorm's
``num_batches_tracked`` absent from the dict keeps its value and is not reported (PyTorch does the
same for state dicts written before it had that buffer, as torchvision's weights are). Every
entry is checked and converted before the first write, so an error changes nothing.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import numpy as np

from .engine import core as _core
from .tensor import Tensor, array, from_dlpack

PREFIX = "module."  # what DataParallel and DistributedDataParallel put before every name


def strip_prefix(keys: List[str], targets: Mapping[str, Tensor]) -> bool:
    """Whether the incoming ``keys`` carry DataParallel's prefix that ``targets`` lack."""
    return (bool(keys) and all(k.startswith(PREFIX) for k in keys)
            and not any(k.startswith(PREFIX) for k in targets))


def _source(value, key: str) -> Tensor:
    """An mgpu tensor holding ``value`` (shared where it can be, else a copy)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        try:
            return array(value)  # floats as float32, integers as int64 unless mgpu holds them
        except TypeError as e:
            raise TypeError(f"load_state_dict: entry '{key}': {e}. Nothing was loaded.") from None
    if not hasattr(value, "__dlpack__"):
        raise TypeError(f"load_state_dict: entry '{key}' is a {type(value).__name__}; expected an "
                        "mgpu tensor, a NumPy array or an object with __dlpack__ (a PyTorch "
                        "tensor, ...). Nothing was loaded.")
    try:
        return from_dlpack(value)  # contiguous and of a dtype mgpu holds: no copy
    except (TypeError, ValueError, RuntimeError) as direct:  # PyTorch: a tensor needing grad
        try:  # a strided view or another element type: through NumPy, converted below
            return array(np.from_dlpack(value))
        except (TypeError, ValueError, BufferError, RuntimeError) as e:
            raise TypeError(
                f"load_state_dict: entry '{key}' ({type(value).__name__}) cannot be read through "
                f"DLPack ({direct}; through NumPy: {e}); pass a detached float32 tensor (e.g. "
                "t.detach().float()). Nothing was loaded.") from None


def load_into(owner: str, targets: Mapping[str, Tensor], state_dict: Mapping, strict: bool,
              optional: frozenset = frozenset()) -> Tuple[List[str], List[str]]:
    """Copies ``state_dict``'s values into ``targets`` (name -> the module's tensor) by name and
    returns (missing_keys, unexpected_keys). ``owner`` names the module in errors; ``optional``
    keys may be absent without being missing. Raises before any write on a problem."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict: expected a mapping of names to tensors, got "
                        f"{type(state_dict).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"load_state_dict: strict must be a bool, got {type(strict).__name__}")
    keys = list(state_dict.keys())
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(f"load_state_dict: keys must be str, got {bad[0]!r} "
                        f"({type(bad[0]).__name__}). Nothing was loaded.")
    cut = len(PREFIX) if strip_prefix(keys, targets) else 0
    incoming = {k[cut:]: state_dict[k] for k in keys}
    missing = [k for k in targets if k not in incoming and k not in optional]
    unexpected = [k for k in incoming if k not in targets]
    problems = []
    if strict and missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
    if strict and unexpected:
        problems.append("Unexpected key(s) in state_dict: "
                        + ", ".join(f'"{k}"' for k in unexpected))
    staged: Dict[str, Tensor] = {}
    for k, t in targets.items():
        if k not in incoming:
            continue
        v = incoming[k]
        shape = getattr(v, "shape", None)
        if shape is not None and tuple(shape) != tuple(t.shape):
            problems.append(f"size mismatch for {k}: copying a param with shape {tuple(shape)} "
                            f"from checkpoint, the shape in current model is {tuple(t.shape)}")
            continue
        src = _source(v, k)
        if tuple(src.shape) != tuple(t.shape):
            problems.append(f"size mismatch for {k}: copying a param with shape "
                            f"{tuple(src.shape)} from checkpoint, the shape in current model is "
                            f"{tuple(t.shape)}")
            continue
        # Converted before the first write, so a failing conversion changes nothing; a copy
        # also keeps a value that shares memory with its producer from being aliased.
        if src.device != t.device:
            src = src.copyto(t.device)
        if src.dtype != t.dtype:
            src = src.astype(t.dtype)
        staged[k] = src
    if problems:
        raise ValueError(f"Error(s) in loading state_dict for {owner}: " + "; ".join(problems)
                         + ". Nothing was loaded.")
    for k, src in staged.items():
        _core.copy(targets[k]._t, src._t)
        targets[k]._t.bump_version()  # a write, as every in-place one (DataParallel's replicas)
    return missing, unexpected


__all__ = ["PREFIX", "strip_prefix", "load_into"]
