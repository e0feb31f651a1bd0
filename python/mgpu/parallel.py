"""Data parallelism, the chapter's way (sec. 12.5.4-12.5.6): replicate parameters, sum gradients,
split minibatches, take the same SGD step everywhere -- and the fused ``train_batch`` that does all
of it in one C++ call.

The fused step runs any list of layers (``FusedModel``; LeNet is one such model, DataParallel's
``train_step`` builds one from a module tree). Gradients sit in one flat buffer per replica. On
GPUs they are cut into buckets in reverse layer order (the first closes after 256 KB, later ones
after 4 MB) and each bucket is all-reduced (NCCL, or mgpu's peer copies) as soon as backward has
produced it, on a communication stream while the earlier layers' backward runs; then every replica
takes the SGD step; each replica's forward and backward are captured as CUDA graphs the first time
a shape is seen and replayed after (``MGPU_CUDA_GRAPH=0`` turns this off). CPU devices of one
process share memory and cores, so there the sum and the update are one collective after
backward: device j sums chunk j of the flat gradients over the replicas and updates chunk j of
every replica's parameters, with the same bits as the bucketed path (``MGPU_CPU_SHARED_UPDATE=0``).
Sums run in a fixed order (no atomics), so results are reproducible run to run; with
``deterministic=True`` they are the same bits on any number of devices.
"""
from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import distributed as _dist
from . import trace as _trace
from .amp import check_comm_dtype, check_precision
from .device import Device, as_device
from .engine import core as _core
from .nn_utils import check_max_norm
from .optim.optimizers import check_betas
from .random import check_seed
from .tensor import Tensor, array, check_int, check_nonnegative, engine_handle


def get_params(params: Sequence[Tensor], device: Device) -> List[Tensor]:
    """Copies the parameters (mgpu tensors or NumPy arrays) to ``device`` and attaches zero
    gradients to the copies."""
    device = as_device(device)
    new_params = []
    for i, p in enumerate(params):
        if isinstance(p, Tensor):
            new_params.append(p.copyto(device))
        elif isinstance(p, np.ndarray):
            new_params.append(array(p, device=device, dtype=np.float32))
        else:
            raise TypeError(f"get_params: params[{i}] is a {type(p).__name__}; expected mgpu "
                            "tensors or NumPy arrays")
    for p in new_params:
        p.attach_grad()
    return new_params


def _flat_tensors(data) -> List[List["_core.Tensor"]]:
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("allreduce: pass a non-empty list with one tensor (or one list of "
                         "tensors) per device")
    out = []
    for i, entry in enumerate(data):
        items = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        for t in items:
            if not isinstance(t, Tensor):
                raise TypeError(f"allreduce: entry {i} holds {type(t).__name__}, expected mgpu "
                                "tensors (a .grad that is None has not been attached)")
        out.append([t._t for t in items])
    return out


@_trace.span("allreduce")
def allreduce(data) -> None:
    """Sums tensors across devices in place; afterwards every device holds the sum.

    ``data`` has one entry per device: a tensor, or a list of tensors (all reduced as one flat
    buffer in a single collective -- the efficient all-reduce of the chapter's exercise).
    """
    _core.allreduce(_flat_tensors(data))
    for entry in data:  # summed in place
        for t in (entry if isinstance(entry, (list, tuple)) else [entry]):
            t._t.bump_version()


@_trace.span("split_batch")
def split_batch(X: Tensor, y: Tensor,
                devices: Sequence[Device]) -> Tuple[List[Tensor], List[Tensor]]:
    """Splits X and y along axis 0 into one shard per device (sizes differ by at most one)."""
    engine_handle(X, "split_batch", "X"), engine_handle(y, "split_batch", "y")
    if X.shape[:1] != y.shape[:1]:
        raise ValueError(f"split_batch: X and y must hold the same number of examples, got "
                         f"X {X.shape} and y {y.shape}")
    devices = [as_device(d) for d in devices]
    return ([Tensor(t) for t in _core.split_rows(X._t, devices)],
            [Tensor(t) for t in _core.split_rows(y._t, devices)])


def split_and_load(data: Tensor, devices: Sequence[Device]) -> List[Tensor]:
    """Gluon's name: splits one tensor along axis 0 over the devices."""
    return [Tensor(t) for t in _core.split_rows(engine_handle(data, "split_and_load", "data"),
                                                [as_device(d) for d in devices])]


def check_lr(lr, op: str) -> float:
    """``lr`` as a float; ValueError unless it is a finite number > 0 (NaN would train silently)."""
    if isinstance(lr, bool) or not isinstance(lr, (numbers.Real, np.number)):
        raise TypeError(f"{op}: lr must be a number, got {type(lr).__name__}")
    lr = float(lr)
    if not (np.isfinite(lr) and lr > 0):
        raise ValueError(f"{op}: the learning rate must be a finite number > 0, got {lr}")
    return lr


def check_batch_size(batch_size, op: str) -> int:
    n = check_int(batch_size, op, "batch_size")
    if n < 1:
        raise ValueError(f"{op}: batch_size must be >= 1, got {n}")
    return n


# Logical shards of deterministic=True: a fixed count (not a size), so every global batch -- the
# uneven last one too -- is cut the same way whatever the devices; 8 keeps 1, 2, 4 and 8 devices
# evenly loaded and each shard big enough for the kernels to stay efficient.
DEFAULT_SHARDS = 8


def shard_count(deterministic, op: str) -> int:
    """The logical shard count of ``deterministic``: 0 for False (one shard per device, today's
    fastest step), DEFAULT_SHARDS for True, or the given count n >= 1."""
    if deterministic is None or deterministic is False:
        return 0
    if deterministic is True:
        return DEFAULT_SHARDS
    if not isinstance(deterministic, (numbers.Integral, np.integer)):
        raise TypeError(f"{op}: deterministic must be True, False or a number of logical shards, "
                        f"got {type(deterministic).__name__}")
    n = int(deterministic)
    if n < 1:
        raise ValueError(f"{op}: deterministic takes a number of logical shards >= 1 (or True "
                         f"for {DEFAULT_SHARDS}), got {n}")
    return n


def check_accumulate(accumulate, shards: int, op: str) -> int:
    """``accumulate`` (micro-batches per step) as an int; TypeError unless it is an integer,
    ValueError unless it is >= 1 and, in deterministic mode (``shards`` logical shards > 0),
    divides ``shards`` (each micro-batch is a run of whole shards). Changes nothing."""
    k = check_int(accumulate, op, "accumulate (the number of micro-batches per step)")
    if k < 1:
        raise ValueError(f"{op}: accumulate must be >= 1 (the number of micro-batches per step; "
                         f"1 takes the batch at once), got {k}")
    if shards and shards % k:
        works = [d for d in range(1, shards + 1) if shards % d == 0]
        raise ValueError(f"{op}: accumulate={k} does not divide the {shards} logical shards of "
                         f"deterministic mode (each micro-batch is a run of whole shards); use "
                         f"accumulate in {works}, or deterministic=<a multiple of {k}>")
    return k


def _scale(lr: float, batch_size: int) -> float:
    # float32 arithmetic, exactly as the fused step computes lr / N in C++.
    return float(np.float32(lr) / np.float32(batch_size))


def sgd(params: Sequence[Tensor], lr: float, batch_size: int) -> None:
    """Minibatch SGD in place: p -= lr * p.grad / batch_size, then the gradients are zeroed."""
    scale = _scale(check_lr(lr, "sgd"), check_batch_size(batch_size, "sgd"))
    params = list(params)
    for i, p in enumerate(params):  # all checked before any is changed
        engine_handle(p, "sgd", f"params[{i}]")
        if p.grad is None:
            raise ValueError("sgd: a parameter has no gradient; attach one with attach_grad() "
                             "or requires_grad_() and run backward() first")
    for p in params:
        _core.sgd_update(p._t, p.grad._t, scale)
        p._t.bump_version()
        p.grad.zero_()


def _replicas(device_params, devices) -> Tuple[list, list]:
    devices = [as_device(d) for d in devices]
    handles = []
    for i, ps in enumerate(device_params):
        if not isinstance(ps, (list, tuple)):
            raise TypeError(f"device_params[{i}] must be a list of the parameters on devices[{i}]")
        handles.append([engine_handle(p, "train_batch", f"device_params[{i}][{j}]")
                        for j, p in enumerate(ps)])
    return handles, devices


def train_batch(X: Tensor, y: Tensor, device_params, devices: Sequence[Device],
                lr: float, deterministic=False, accumulate: int = 1,
                precision: str = "float32") -> List[Tensor]:
    """One fused data-parallel LeNet step (GIL released, every device at once).

    Splits the minibatch over ``devices``, computes each shard's loss and gradients on its
    device, sums the gradients across devices, and updates every replica in place with
    p -= lr * grad / X.shape[0]. Returns each device's summed loss (0-d tensors). Under mpirun
    (``mgpu.distributed``) X, y are the global batch on every rank: each rank trains on its slice
    and gradients are summed across processes too, so all ranks take the global step.

    ``deterministic=True`` (or a number of logical shards; True means ``DEFAULT_SHARDS``) cuts
    the batch into that many shards whatever the devices, computes each shard whole on one device
    and adds the shard gradients in one fixed tree: 1, 2, 3, 4 devices, and k processes x m
    devices under mpirun, give bitwise the same parameters. The whole loss is then returned by
    the first device (of rank 0) and the others return 0.

    ``accumulate=K`` runs the batch as K micro-batches one after another (for K times less
    activation memory), sums their gradients on each device and only then across devices and
    ranks, and takes one update with the whole batch's scale: the step of the whole batch (to
    float tolerance; bitwise with ``deterministic``, where K must divide the shard count).

    ``precision="bf16"`` runs the products of both convolutions and both linear layers (forward,
    data and weight gradients) with bfloat16 operands and float32 sums, as
    ``mgpu.autocast("bf16")`` runs them (cpp/ops/bf16.h: the rounding, the order of the sums, the
    error bound; on CPUs LeNet's conv blocks run float32's fused conv + relu + pool kernel on
    their rounded operands, on GPUs conv, relu and pool one after another). Bias, relu,
    pooling, the loss, the sums across devices and the SGD update stay float32, and so do the
    parameters (the master weights). The bits are the same on every CPU kernel path
    (``MGPU_ISA``), and on mgpu's GPU kernels as on the CPU's bfloat16 products
    (``MGPU_CONV_ALGO=direct``); ``deterministic`` keeps them the same on any number of devices.
    """
    lr = check_lr(lr, "train_batch")
    shards = shard_count(deterministic, "train_batch")
    accumulate = check_accumulate(accumulate, shards, "train_batch")
    precision = check_precision(precision, "train_batch: precision")
    return run_batch(X, y, device_params, devices, lr, shards, accumulate, precision)


@_trace.span("train_batch")  # the step's span, whichever entry called it
def run_batch(X: Tensor, y: Tensor, device_params, devices: Sequence[Device], lr: float,
              shards: int, accumulate: int, precision: str = "float32") -> List[Tensor]:
    """:func:`train_batch` with its numbers checked already, by it or by a loop that checked
    them once where the user gave them (``mgpu.train``): ``lr`` from ``check_lr``, ``shards``
    the logical shard count (``shard_count``), ``accumulate`` from ``check_accumulate``,
    ``precision`` from ``check_precision``; the C++ step trusts them (a NaN lr here trains
    every replica into NaN). X, y and the replicas are checked as every step's data."""
    Xh, yh = engine_handle(X, "train_batch", "X"), engine_handle(y, "train_batch", "y")
    _dist.auto_init()
    handles, devices = _replicas(device_params, devices)
    losses = [Tensor(t) for t in _core.train_batch(Xh, yh, handles, devices, lr, shards,
                                                    accumulate, precision)]
    for ps in device_params:  # updated in place
        for p in ps:
            p._t.bump_version()
    return losses


@_trace.span("evaluate_counts")
def evaluate_counts(X: Tensor, y: Tensor, device_params, devices: Sequence[Device]) -> List[Tensor]:
    """Correct predictions of the replicas on one batch, split over the devices (0-d each)."""
    Xh, yh = engine_handle(X, "evaluate_accuracy", "X"), engine_handle(y, "evaluate_accuracy", "y")
    handles, devices = _replicas(device_params, devices)
    return [Tensor(t) for t in _core.evaluate_batch(Xh, yh, handles, devices)]


def _tensors(items, what: str) -> List["_core.Tensor"]:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"FusedModel: {what} must be a list of mgpu tensors, got "
                        f"{type(items).__name__}")
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise TypeError(f"FusedModel: {what}[{i}] is {type(t).__name__}, expected an mgpu "
                            "tensor")
        out.append(t._t)
    return out


class SteadyAllocations:
    """``with`` around each step of a repeated step: the CPU allocator's warm-up, so later steps
    take nothing from the system.

    The first step records, per size class, the most CPU blocks live at once
    (``_core.cpu_trace_begin``/``_end``); before the second, the allocator keeps that many: each
    step starts once the previous one's tasks have run, so later steps take nothing from the
    system whatever order the device threads release theirs in (see ``_core.cpu_reserve``). Small
    blocks (up to 64 KiB: every request of the first step) get as many again and a few more, for
    what later steps add (the label guard's copies of the state when the labels were on a queue
    already) and results of the previous step the caller may still hold (its loss). A step that
    raises is not counted.
    """

    def __init__(self):
        self.steps = 0  # steps taken
        self.trace: Dict[int, int] = {}  # most CPU blocks live at once per class, step 1

    def __enter__(self) -> "SteadyAllocations":
        if self.steps == 1 and self.trace:
            _core.waitall()
            _core.cpu_reserve({size: 2 * n + 4 if size <= 65536 else n
                               for size, n in self.trace.items()})
        if self.steps == 0:
            _core.cpu_trace_begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.steps == 0:
            self.trace = _core.cpu_trace_end()
        if exc_type is None:
            self.steps += 1


class FusedModel:
    """A network given as a list of layers (the spec of ``mgpu._core.Model``), one replica per
    device, trained by one fused data-parallel step per minibatch.

    ``device_params[d]`` and ``device_buffers[d]`` are the tensors of devices[d]'s replica; the step
    updates them in place (pass a module's own parameters as replica 0 and they stay current).
    Every replica steps itself with the same summed gradients, so replicas stay equal.
    """

    def __init__(self, spec, device_params, device_buffers, devices: Sequence[Device]):
        devices = [as_device(d) for d in devices]
        if not isinstance(device_params, (list, tuple)) or not isinstance(
                device_buffers, (list, tuple)):
            raise TypeError("FusedModel: device_params and device_buffers must be lists with one "
                            "list of tensors per device")
        params = [_tensors(ps, f"device_params[{i}]") for i, ps in enumerate(device_params)]
        buffers = [_tensors(bs, f"device_buffers[{i}]") for i, bs in enumerate(device_buffers)]
        if not isinstance(spec, (list, tuple)):
            raise TypeError(f"FusedModel: spec must be a list of (kind, options) tuples, got "
                            f"{type(spec).__name__}")
        self._model = _core.Model(list(spec), params, buffers, devices)
        self.devices = devices
        self._num_params = len(params[0])
        # What a step changes in place (every replica's parameters and buffers): their versions
        # move after each step, so a graph that saved one of them refuses backward.
        self._changed = [t for d in range(len(devices))
                         for t in self._model.params(d) + self._model.buffers(d)]

    def train_step(self, X: Tensor, y: Tensor, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, deterministic=False, optimizer: str = "sgd",
                   betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, step: int = 1,
                   max_norm: Optional[float] = None, lrs: Sequence[float] = (),
                   weight_decays: Sequence[float] = (), accumulate: int = 1,
                   amsgrad: bool = False, seed: int = 0,
                   comm_dtype: str = "float32") -> List[Tensor]:
        """One optimizer step on the mean loss over the whole batch; returns each replica's
        summed loss (0-d tensors). ``optimizer`` 'sgd' (PyTorch's rule, with momentum and weight
        decay), 'adam' or 'adamw' (PyTorch's, at ``step`` counted from 1, with ``betas`` and
        ``eps``; ``amsgrad``: its variant, the denominator from the running maximum of the second
        moment); ``max_norm``: the gradient clipped to that global norm first (as
        ``nn.utils.clip_grad_norm_``); ``lrs`` and ``weight_decays``: one value per parameter
        instead of ``lr`` and ``weight_decay``. ``deterministic`` and ``accumulate`` as for
        ``train_batch`` (batch norm then normalises per logical shard, or per micro-batch and
        replica, and its running statistics move once per micro-batch). ``seed`` (an integer in
        [0, 2**64)): the step's dropout masks, a function of (seed, the layer's index in the
        spec, the example's row in X, the element's index in the example), so the same on any
        split of X over devices, ranks and micro-batches. ``comm_dtype`` "bf16":
        the gradients all-reduced in bfloat16 (``DataParallel.train_step`` says how).

        Every argument is checked here, before anything changes: :meth:`run_step` and the C++
        step below it trust them."""
        if not isinstance(X, Tensor) or not isinstance(y, Tensor):
            raise TypeError(f"train_step: X and y must be mgpu tensors, got "
                            f"{type(X).__name__} and {type(y).__name__}")
        lr, momentum, weight_decay = (check_nonnegative(v, "train_step", name) for v, name in (
            (lr, "lr"), (momentum, "momentum"), (weight_decay, "weight_decay")))
        if isinstance(lrs, (str, bytes)) or not isinstance(lrs, (list, tuple, np.ndarray)):
            raise TypeError(f"train_step: lrs must be a list of numbers, got "
                            f"{type(lrs).__name__}")
        lrs = [check_nonnegative(v, "train_step", f"lrs[{i}]") for i, v in enumerate(lrs)]
        shards = shard_count(deterministic, "train_step")
        accumulate = check_accumulate(accumulate, shards, "train_step")
        seed = check_seed(seed, "train_step")
        comm = check_comm_dtype(comm_dtype, "train_step: comm_dtype")
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"train_step: optimizer must be 'sgd', 'adam' or 'adamw', got "
                             f"{optimizer!r}")
        betas = check_betas(betas, "train_step")
        eps = check_nonnegative(eps, "train_step", "eps")
        step = check_int(step, "train_step", "step (Adam's step count, from 1)")
        if step < 1:
            raise ValueError(f"train_step: Adam's step count starts at 1, got {step}")
        if amsgrad and optimizer == "sgd":
            raise ValueError("train_step: amsgrad is a variant of 'adam' and 'adamw', not of "
                             "'sgd'")
        if max_norm is not None:
            max_norm = check_max_norm(max_norm, "train_step")
        if isinstance(weight_decays, (str, bytes)) or not isinstance(
                weight_decays, (list, tuple, np.ndarray)):
            raise TypeError(f"train_step: weight_decays must be a list of numbers, got "
                            f"{type(weight_decays).__name__}")
        weight_decays = [check_nonnegative(v, "train_step", f"weight_decays[{i}]")
                         for i, v in enumerate(weight_decays)]
        for name, values in (("lrs", lrs), ("weight_decays", weight_decays)):
            if values and len(values) != self._num_params:
                raise ValueError(f"train_step: {name} must hold one value per parameter "
                                 f"({self._num_params}), got {len(values)}")
        return self.run_step(X, y, lr, momentum, weight_decay, shards, optimizer, betas, eps,
                             step, max_norm, lrs, weight_decays, accumulate, amsgrad, seed, comm)

    def run_step(self, X: Tensor, y: Tensor, lr: float, momentum: float, weight_decay: float,
                 shards: int, optimizer: str, betas: Tuple[float, float], eps: float, step: int,
                 max_norm: Optional[float], lrs: Sequence[float], weight_decays: Sequence[float],
                 accumulate: int, amsgrad: bool, seed: int = 0,
                 comm_dtype: str = "float32") -> List[Tensor]:
        """:meth:`train_step` with its arguments already checked, by it or by the caller that
        read them from the user (``DataParallel.train_step`` from its trainer's parameter
        groups, checked by ``Optimizer.current_groups``): ``shards`` is the logical shard count
        (``shard_count``), ``comm_dtype`` the canonical name (``amp.check_comm_dtype``), and no
        hyperparameter is looked at again, here or in C++ (a NaN here trains every replica into
        NaN)."""
        _dist.auto_init()
        # A label out of range raises IndexError and changes nothing (the step checks them).
        losses = self._model.train_step(X._t, y._t, lr, momentum, weight_decay, shards,
                                        optimizer, tuple(betas), eps, step, max_norm,
                                        list(lrs), list(weight_decays), accumulate,
                                        bool(amsgrad), seed,
                                        "bfloat16" if comm_dtype == "bf16" else "float32")
        for t in self._changed:  # updated in place
            t.bump_version()
        return [Tensor(t) for t in losses]

    def evaluate_counts(self, X: Tensor, y: Tensor) -> List[Tensor]:
        """Correct predictions (batch norm with running statistics), one 0-d count per replica."""
        return [Tensor(t) for t in self._model.evaluate_batch(X._t, y._t)]

    def forward(self, X: Tensor, replica: int = 0) -> Tensor:
        """The logits of replica ``replica`` (evaluation mode) for X on its device."""
        return Tensor(self._model.forward(X._t, replica))

    def momentum_buffers(self, replica: int = 0, which: int = 0) -> List[Optional[Tensor]]:
        """SGD's momentum buffers (which 0; Adam's first moments too), Adam's second moments
        (which 1) or amsgrad's running maxima of them (which 2) of one replica, one per
        parameter (None before the first step that makes them); views of the replica's state,
        updated by every step."""
        return [None if b is None else Tensor(b)
                for b in self._model.momentum_buffers(replica, which)]

    def set_momentum_buffers(self, buffers: Sequence[Optional[Tensor]], replica: int = 0,
                             which: int = 0) -> None:
        """Copies ``buffers`` (one per parameter, its shape, any device; None: a fresh buffer,
        so the next step starts it as PyTorch does) into one replica's SGD momentum or Adam's
        first moments (which 0), Adam's second moments (which 1) or amsgrad's maxima of them
        (which 2); the next step continues from them."""
        if not isinstance(buffers, (list, tuple)):
            raise TypeError(f"set_momentum_buffers: buffers must be a list with one tensor (or "
                            f"None) per parameter, got {type(buffers).__name__}")
        handles = []
        for i, b in enumerate(buffers):
            if b is not None and not isinstance(b, Tensor):
                raise TypeError(f"set_momentum_buffers: buffers[{i}] is {type(b).__name__}, "
                                "expected an mgpu tensor or None")
            handles.append(None if b is None else b._t)
        self._model.set_momentum_buffers(replica, handles, which)
