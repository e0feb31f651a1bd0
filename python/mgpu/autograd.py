"""Reverse-mode automatic differentiation over mgpu's ops (a tape of recorded nodes).

An op whose inputs require grad records a :class:`Node` holding its backward function.
``loss.backward()`` walks the nodes in reverse topological order and adds each leaf's gradient
into ``leaf.grad`` (for a non-scalar loss it back-propagates the sum, as the chapter's MXNet code
relies on). Recording is on by default (PyTorch's behaviour); ``with mgpu.autograd.record():`` is
accepted so the MXNet flavour of the chapter runs too, and ``mgpu.no_grad()`` turns it off.
In-place operations are never recorded, but they are noticed: every in-place change bumps the
version counter of the tensor's memory (shared by its views), each recorded op keeps the versions
of the tensors it saved, and ``backward()`` raises RuntimeError naming the op if one of them
changed since -- the gradient would otherwise be computed from the new values (PyTorch's rule).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional, Sequence

from . import trace as _trace

_state = threading.local()


def is_recording() -> bool:
    """Whether ops on tensors that require grad are being recorded (per thread)."""
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def set_grad_enabled(flag: bool):
    """Context manager under which recording is ``flag`` on this thread, restored after
    (PyTorch's name)."""
    old = is_recording()
    _state.enabled = flag
    try:
        yield
    finally:
        _state.enabled = old


def record():
    """Context manager that records ops for backward (already the default)."""
    return set_grad_enabled(True)


def no_grad():
    """Context manager under which nothing is recorded."""
    return set_grad_enabled(False)


class Node:
    """One recorded op: its inputs, the versions of the tensors its backward reads, and a
    function from the output's gradient to the inputs'."""

    __slots__ = ("inputs", "backward_fn", "saved", "op")

    def __init__(self, inputs: Sequence, backward_fn: Callable, saved: Sequence, op: str):
        self.inputs = tuple(inputs)
        self.backward_fn = backward_fn  # dy -> tuple of gradients (None where not needed)
        self.saved = tuple((t, t._t.version) for t in saved if t is not None)
        self.op = op

    def check_saved(self) -> None:
        for t, version in self.saved:
            now = t._t.version
            if now != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: the {t.dtype} tensor of shape {t.shape} on {t.device} "
                    f"saved by {self.op} is at version {now}; expected version {version} "
                    "instead. Compute the gradient before changing it in place, or change a "
                    "copy (t.copy()).")


def _op_name(fn: Callable) -> str:
    """The op a backward function belongs to: ``conv2d`` for ``conv2d.<locals>.backward``."""
    name = getattr(fn, "__qualname__", "") or "an op"
    return name.split(".<locals>")[0]


def attach(out, inputs: Sequence, backward_fn: Callable, saved: Optional[Sequence] = None,
           op: Optional[str] = None):
    """Records ``out = op(*inputs)`` when any input requires grad; returns ``out``.

    ``saved`` are the tensors the backward reads (by default every input): their versions are
    kept, and backward() refuses to run if one has changed in place since. ``op`` names the op
    in that error (by default the function that defines ``backward_fn``).
    """
    if is_recording() and any(t is not None and t.requires_grad for t in inputs):
        out.requires_grad = True
        out._node = Node(inputs, backward_fn, inputs if saved is None else saved,
                         op or _op_name(backward_fn))
    return out


def _topological(root) -> List:
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen or t._node is None:
            continue
        seen.add(id(t))
        stack.append((t, True))
        for x in t._node.inputs:
            if x is not None and x.requires_grad and x._node is not None and id(x) not in seen:
                stack.append((x, False))
    return order


def backward(root, grad) -> None:
    """Back-propagates ``grad``, the gradient of ``root`` (a tensor of its shape on its device:
    ``Tensor.backward`` checks it and defaults it to ones, the gradient of a sum)."""
    order = _topological(root)
    for t in order:  # before any gradient is written: a refused backward changes nothing
        t._node.check_saved()
    grads = {id(root): grad}
    with no_grad():
        for t in reversed(order):
            dy = grads.pop(id(t))
            if _trace.active:  # a host span per op's backward on the timeline
                with _trace.scope(t._node.op + " backward"):
                    dxs = t._node.backward_fn(dy)
            else:
                dxs = t._node.backward_fn(dy)
            for x, g in zip(t._node.inputs, dxs):
                if x is None or g is None or not x.requires_grad:
                    continue
                if x._node is None:
                    _accumulate_leaf(x, g)
                elif id(x) in grads:
                    grads[id(x)] = grads[id(x)] + g
                else:
                    grads[id(x)] = g
        if root._node is None:
            _accumulate_leaf(root, grads.pop(id(root)))


def zero_grads(params, set_to_none: bool) -> None:
    """Clears the gradients of ``params`` (Module.zero_grad, Optimizer.zero_grad): to None
    (PyTorch's default), or to zeros in place."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()


def _accumulate_leaf(x, g) -> None:
    if x.grad is None:
        # A copy: g may be shared with another input's gradient (an add passes dy to both).
        x.grad = g.copyto(x.device)
    else:
        x.grad += g
