"""``nn.DataParallel`` and ``nn.SyncBatchNorm``: the concise chapter's one-line wrapper (sec. 12.6).

The master module on ``device_ids[0]`` is the only copy an optimizer sees; each forward splits
the batch, refreshes per-device replicas from the master (recorded copies, so backward sums the
replicas' gradients into the master's ``.grad``) and gathers the outputs on ``device_ids[0]``.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import autograd, nn
from . import ops as functional
from . import random as _random
from . import trace as _trace
from .amp import check_comm_dtype, check_precision
from .device import Device, as_device, try_all_gpus, try_gpu
from .engine import core as _core
from .fused_spec import BATCH_NORM_CONDITION, SpecBuilder, batch_norm, emits
from .nn import BatchNormBase, Module, check_input, module_calls
from .nn import CrossEntropyLoss as nn_CrossEntropyLoss
from .nn_utils import check_max_norm
from .optim import SGD as optim_SGD
from .optim import Adam as optim_Adam
from .parallel import FusedModel, SteadyAllocations, check_accumulate, shard_count
from .tensor import Tensor, zeros_like

# Replica modules are shallow copies of the master's modules: these entries of a module's
# __dict__ are per replica; everything else (hyperparameters, training flag) is the master's.
_OWN = ("_parameters", "_buffers", "_modules", "_sync_group", "_sync_rank")


def _as_dp_device(d) -> Device:
    if isinstance(d, bool):
        raise TypeError(f"DataParallel: device_ids holds {d!r}; pass devices such as mgpu.cpu(0)")
    if isinstance(d, int):
        return try_gpu(d)  # an index means the book's try_gpu(i)
    try:
        return as_device(d)
    except TypeError:
        raise TypeError(f"DataParallel: device_ids holds {d!r}; pass devices such as "
                        "mgpu.try_gpu(0), mgpu.cpu(1), 'gpu:0', or indices") from None


def _device_list(device_ids) -> List[Device]:
    if device_ids is None:
        return try_all_gpus()
    if isinstance(device_ids, (str, Device)) or not hasattr(device_ids, "__iter__"):
        raise TypeError(f"DataParallel: device_ids must be a list of devices, got "
                        f"{type(device_ids).__name__}")
    devices = [_as_dp_device(d) for d in device_ids]
    if not devices:
        raise ValueError("DataParallel: device_ids is empty; pass at least one device")
    if len({d.kind for d in devices}) > 1:
        raise ValueError(f"DataParallel: device_ids mixes CPU and GPU devices ({devices}); use "
                         "only GPUs or only (virtual) CPU devices")
    if len({str(d) for d in devices}) != len(devices):
        raise ValueError(f"DataParallel: device_ids repeats a device ({devices}); list each "
                         "device once")
    return devices


class _Replica:
    """One device's copy of the module tree: (replica module, master module) pairs."""

    def __init__(self, master: Module, device: Device):
        self.device = device
        self.pairs: List[Tuple[Module, Module]] = []
        self.root = self._copy(master, {})
        # Under DataParallel.no_sync(): per (pair index, name), a leaf copy of the master's
        # parameter on this device whose .grad holds this replica's gradients not yet sent to
        # the master, with the master tensor, its memory handle and version it was copied from.
        self.local: Dict[Tuple[int, str], Tuple[Tensor, Tensor, _core.Tensor, int]] = {}

    def _copy(self, m: Module, memo: Dict[int, Module]) -> Module:
        if id(m) in memo:
            return memo[id(m)]
        r = type(m).__new__(type(m))
        r.__dict__.update({k: v for k, v in m.__dict__.items() if k not in _OWN})
        r.__dict__["_parameters"] = OrderedDict((k, None) for k in m._parameters)
        r.__dict__["_buffers"] = OrderedDict((k, None) for k in m._buffers)
        r.__dict__["_modules"] = OrderedDict()
        memo[id(m)] = r
        self.pairs.append((r, m))
        for name, child in m._modules.items():
            r._modules[name] = None if child is None else self._copy(child, memo)
        return r

    def refresh(self, sync: bool = True) -> Module:
        """Copies the master's state in: parameters recorded (gradients flow back to the
        master), buffers into this replica's own tensors, other attributes by reference.
        ``sync=False`` (no_sync): parameters are this device's own leaves instead, whose
        gradients stay here until the next recorded copy's backward takes them along."""
        dev = self.device
        for i, (r, m) in enumerate(self.pairs):
            r.__dict__.update({k: v for k, v in m.__dict__.items() if k not in _OWN})
            for name, p in m._parameters.items():
                if p is None:
                    r._parameters[name] = None
                elif sync:
                    entry = self.local.get((i, name))
                    r._parameters[name] = p.to(dev) if entry is None or entry[0].grad is None \
                        else _to_with_pending(p, dev, entry[0])
                else:
                    r._parameters[name] = self._local_leaf(i, name, p)
            for name, b in m._buffers.items():
                if b is None:
                    r._buffers[name] = None
                    continue
                rb = r._buffers.get(name)
                if rb is None or rb.shape != b.shape or rb.dtype != b.dtype:
                    rb = Tensor(_core.Tensor.empty(list(b.shape), b.dtype.name, dev))
                    r._buffers[name] = rb
                _core.copy(rb._t, b._t)
        return self.root

    def _local_leaf(self, i: int, name: str, p: Tensor) -> Tensor:
        """The leaf copy of master parameter ``p`` on this device, copied again only when the
        master may have changed since (so graphs that saved it stay valid between
        micro-batches). Current means: the same tensor, the same memory (``Module.to`` gives
        new memory, whose version counts from 0 again, even when a second move brings it
        back) and the same version; memory another library can write without moving the
        version (DLPack, ``_core.Tensor.exposed``) is compared with the copy by value instead,
        on the host: rare, and a copy into the leaf would break a graph that saved it."""
        entry = self.local.get((i, name))
        h = p._t
        current = entry is not None and entry[1] is p and entry[2] is h \
            and entry[3] == h.version
        if current and h.exposed:
            current = np.array_equal(entry[0].numpy(), p.numpy(), equal_nan=True)
        if current:
            return entry[0]
        if entry is None or entry[0].shape != p.shape:
            leaf = p.copyto(self.device)
        else:
            leaf = p.copyto(entry[0])  # keeps the gradients accumulated here
        leaf.requires_grad = p.requires_grad
        self.local[(i, name)] = (leaf, p, h, h.version)
        return leaf

    def pending(self) -> List[Tuple[Tensor, Tensor]]:
        """(local leaf, master parameter) pairs whose leaf holds gradients not yet sent."""
        return [(e[0], e[1]) for e in self.local.values() if e[0].grad is not None]

    def drop_pending(self) -> None:
        for leaf, _ in self.pending():
            leaf.grad = None


def _to_with_pending(p: Tensor, device: Device, leaf: Tensor) -> Tensor:
    """``p.to(device)`` whose backward also sends ``leaf``'s gradients (accumulated on
    ``device`` under no_sync) to ``p``: one copy carries the sum, and the leaf is emptied."""
    out = Tensor(_core.to_device(p._t, device))
    src = p.device

    def backward(dy):
        g = leaf.grad
        if g is not None:
            leaf.grad = None
            dy = dy + g
        return (dy.to(src),)

    return autograd.attach(out, [p], backward, saved=(), op="to")


class DataParallel(Module):
    """Data parallelism over ``device_ids`` (default: every GPU, or [cpu(0)] without one).

    Design: parameters are copied from the master to the other devices at every forward with the
    recorded ``Tensor.to``, whose backward copies the gradient back; so the book's loop
    ``l = loss(net(X), y); l.backward(); trainer.step()`` is correct with any optimizer (it
    updates the master only, and the next forward starts from it), and the copies cost one
    parameter broadcast per step, the same traffic as syncing replicas after the step.
    Replica module objects are built once per device and reused.

    ``net = nn.DataParallel(net, device_ids=devices)`` moves ``net`` to ``devices[0]`` (in place:
    an optimizer made earlier keeps its parameters) and afterwards ``net(X)`` splits X over the
    devices, runs a replica on each at once (ops run asynchronously per device) and returns the
    outputs gathered on ``devices[0]``; backward sums the replicas' gradients into the wrapped
    module's parameters. A batch smaller than the device count uses the first N devices.

    BatchNorm: each replica normalises with its own shard's statistics (PyTorch's DataParallel,
    Keras' MirroredStrategy and the JAX seed do the same); running statistics are those of
    device_ids[0]'s shard (the master is replica 0), and every forward starts all replicas from
    the master's, so they stay consistent. For statistics over the whole batch convert the
    network with ``nn.SyncBatchNorm.convert_sync_batchnorm(net)``.

    ``net.train_step(X, y, loss, trainer)`` is the same step fused: the module tree becomes a C++
    model (layers over value slots, built on first use), every replica's forward and backward,
    the gradients' sum and the SGD update run in one call without Python, SyncBatchNorm included
    (see its docstring). The book's ``train(net, num_gpus, batch_size, lr)`` is
    ``mgpu.chapter.train_concise`` (``fused=True`` takes this step, ``checkpoint=DIR,
    resume=True`` survives a kill); from a shell, ``mgpu train --model resnet18 [--fused]
    [--sync-bn]``. The fused step takes the modules ``mgpu.models.resnet18`` is made of and
    a few more (``mgpu.fused_spec.supported_modules()`` lists them).

    Gradient accumulation: backward passes under ``with net.no_sync():`` keep each replica's
    gradients on its device until the first backward outside it (see ``no_sync``);
    ``net.train_step(X, y, loss, trainer, accumulate=K)`` runs the batch as K micro-batches in
    one call, with one reduction and one update.
    """

    def __init__(self, module: Module, device_ids: Optional[Sequence] = None,
                 output_device=None):
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DataParallel: expected an mgpu.nn.Module to wrap, got "
                            f"{type(module).__name__}")
        devices = _device_list(device_ids)
        if output_device is not None and as_device(output_device) != devices[0]:
            raise ValueError(f"DataParallel: outputs are gathered on device_ids[0] ({devices[0]})"
                             f"; output_device={output_device} is not supported")
        module.to(devices[0])
        self.module = module
        object.__setattr__(self, "device_ids", devices)
        object.__setattr__(self, "_replicas", {})
        object.__setattr__(self, "_tree", None)
        object.__setattr__(self, "_sync", True)

    def extra_repr(self) -> str:
        return f"device_ids={self.device_ids}"

    def _check_master(self) -> None:
        src = self.device_ids[0]
        for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            if t.device != src:
                raise ValueError(f"DataParallel: the module's '{name}' is on {t.device}, but it "
                                 f"must stay on device_ids[0] = {src}; move it back with "
                                 f"net.module.to({src})")

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager for gradient accumulation in the book's loop, as PyTorch DDP's: the
        backward passes of forwards run inside it send nothing between devices, each replica
        adds its gradients into its own copy on its device (device_ids[0]'s into the
        parameters' ``.grad``), and the backward of the first forward outside it sends each
        replica's accumulated sum to the master with that step's gradients (one copy per
        parameter and device, as a step without accumulation sends)::

            with net.no_sync():
                for Xk, yk in micro_batches[:-1]:
                    loss(net(Xk), yk).backward()
            loss(net(Xl), yl).backward()  # the reduction of every micro-batch's gradients
            trainer.step()

        Gradients not sent yet are dropped by ``net.zero_grad()``, and by a forward that finds
        every parameter's ``.grad`` None (``trainer.zero_grad()`` has run); a change of the
        module tree (a new Parameter object) sends them before the replicas are rebuilt.
        Replicas are refreshed from the master inside too, by a copy only when the master may
        have changed (``_Replica._local_leaf`` says when).
        One process: under mpirun the book's loop does not reduce across ranks; the fused step
        accumulates with ``train_step(..., accumulate=K)``."""
        old = self._sync
        object.__setattr__(self, "_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "_sync", old)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients and the replicas' not yet sent (no_sync)."""
        super().zero_grad(set_to_none)
        for rep in self._replicas.values():
            rep.drop_pending()

    def _settle_pending(self, used: int) -> None:
        """Before a forward: drops the replicas' unsent gradients if the master's were cleared;
        outside no_sync, adds those of replicas this forward leaves out into the master's."""
        reps = [self._replicas.get(str(d)) for d in self.device_ids[1:]]
        reps = [r for r in reps if r is not None and r.pending()]
        if not reps:
            return
        if all(p.grad is None for p in self.module.parameters()):
            for rep in reps:
                rep.drop_pending()
            return
        if self._sync:
            self._send_pending([r for r in reps if r.device not in self.device_ids[1:used]])

    @staticmethod
    def _send_pending(reps: List[_Replica]) -> None:
        """Adds the replicas' unsent gradients into their master parameters' ``.grad``."""
        with autograd.no_grad():
            for rep in reps:
                for leaf, p in rep.pending():
                    g = leaf.grad.to(p.device)
                    leaf.grad = None
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad += g

    def _replica_roots(self, n: int) -> List[Module]:
        tree = tuple(id(m) for m in self.module.modules()) + tuple(
            id(t) for t in self.module.parameters())
        if tree != self._tree:  # the module tree changed since the replicas were built
            if any(p.grad is not None for p in self.module.parameters()):
                # What no_sync kept on the replicas goes to the master before they go.
                self._send_pending(list(self._replicas.values()))
            self._replicas.clear()
            object.__setattr__(self, "_tree", tree)
        sync = self._sync or not autograd.is_recording()
        roots = [self.module]
        for d in self.device_ids[1:n]:
            rep = self._replicas.get(str(d))
            if rep is None:
                rep = self._replicas[str(d)] = _Replica(self.module, d)
            roots.append(rep.refresh(sync))
        return roots

    def forward(self, X: Tensor) -> Tensor:
        X = check_input(X, "DataParallel")
        if X.requires_grad:
            raise NotImplementedError("DataParallel: an input that requires grad is not "
                                      "supported (the scatter is not recorded); pass data tensors")
        if X.ndim == 0:
            raise ValueError("DataParallel: the input needs a batch axis (axis 0) to split")
        self._check_master()
        devices = self.device_ids
        if len(devices) == 1 or X.shape[0] <= 1:
            self._settle_pending(1)
            return self._single(self.module(X.to(devices[0])))
        shards = [Tensor(t) for t in _core.split_rows(X._t, devices)]
        shards = [s for s in shards if s.shape[0] > 0]
        self._settle_pending(len(shards))
        roots = self._replica_roots(len(shards))
        if self.training and any(isinstance(m, SyncBatchNorm) for m in self.module.modules()):
            outs = _run_synced(roots, shards)
        else:
            outs = [r(s) for r, s in zip(roots, shards)]
        for o in outs:
            self._single(o)
        return functional.gather_rows(outs, devices[0])

    @staticmethod
    def _single(out):
        if not isinstance(out, Tensor):
            raise TypeError(f"DataParallel: the module must return one tensor, got "
                            f"{type(out).__name__}")
        return out

    def train_step(self, X: Tensor, y: Tensor, loss, trainer, deterministic=False,
                   clip_grad_norm: Optional[float] = None, accumulate: int = 1,
                   precision: str = "float32", comm_dtype: str = "float32") -> Tensor:
        """One fused data-parallel step: every replica's forward, loss, backward, bucketed
        all-reduce and optimizer update run in C++ from this one call (``mgpu._core.Model``,
        built from the module tree on first use). Computes what the book's loop computes with
        ``loss = nn.CrossEntropyLoss()`` and ``trainer`` an ``optim.SGD`` (lr, momentum,
        weight_decay), ``optim.Adam`` or ``optim.AdamW`` (amsgrad too) over
        ``net.parameters()``, and returns the mean loss (0-d, on device_ids[0]).

        ``clip_grad_norm=max_norm`` clips the summed gradients to that global norm before the
        update, as ``nn.utils.clip_grad_norm_(net.parameters(), max_norm)`` does in the book's
        loop. Each parameter group's current ``'lr'`` and ``'weight_decay'`` are read at every
        step, so a learning-rate scheduler (``optim.lr_scheduler``) drives this step too.

        The master's parameters and running statistics are updated in place; other replicas
        are refreshed from the master before every step, so steps of both kinds can be mixed.
        The optimizer's state (SGD's momentum buffers, Adam's moments, amsgrad's maxima and the
        step) is shared with
        ``trainer``: after a fused step its buffers are views of the fused model's (so
        ``trainer.state_dict()`` holds them), and a step finds buffers that ``trainer.step()``
        or ``trainer.load_state_dict()`` changed and continues from those, so the book's loop
        and the fused step can alternate without losing state.
        ``num_batches_tracked`` is not counted. SyncBatchNorm layers (``nn.SyncBatchNorm.
        convert_sync_batchnorm(net)``) normalise with the statistics of the whole batch, over
        every replica (and every rank under mpirun), combined in a fixed order inside the C++
        step, so k devices compute what one device computes on the whole batch.

        ``deterministic=True`` (or a number of logical shards) gives bitwise the same parameters
        on any number of devices (``parallel.train_batch`` says how); batch norm then normalises
        per logical shard and takes its running statistics from the first shard.

        ``accumulate=K`` is gradient accumulation in this one call: X, y (the whole batch B)
        run as K micro-batches one after another (K times less activation memory), their
        gradients are summed on each device and reduced across devices and ranks once, after
        the last, and one optimizer update follows with the mean over all B examples, the step
        the book's loop takes with K backward() calls under ``no_sync()`` and scaled losses.
        Micro-batches are B's rows split in K parts (sizes differ by at most one) and batch
        norm normalises per micro-batch (and replica), its running statistics moving once per
        micro-batch, as PyTorch's do. Within float tolerance of K = 1 without batch norm; with
        ``deterministic`` (S logical shards, K must divide S) micro-batch k is shards
        [kS/K, (k+1)S/K), their gradients are added in the same tree, and the parameters are
        bitwise those of K = 1 on any device count (batch norm's running statistics are those
        of each micro-batch's first shard, moved K times).

        ``precision="bf16"`` runs the convolutions' and linear layers' products with bfloat16
        operands and float32 sums, as the book's loop does under ``mgpu.autocast("bf16")``
        (``mgpu.amp``); batch norm, the loss and the update stay float32, as do the
        parameters and the all-reduced (and accumulated) gradients. On CPUs a convolution runs
        float32's kernels (Winograd F(4x4, 3x3) at ResNet-18's 3x3 stride-1 layers) on its
        operands rounded to bfloat16, faster than the bfloat16 products there
        (``cpp/ops/bf16.h``): the step is about as fast as float32's, not yet faster. The bf16
        passes give the same bits on every CPU path (and, under ``MGPU_CONV_ALGO=direct``, the
        GPUs' bits), so ``deterministic`` keeps its promise, with ``accumulate`` too.

        ``nn.Dropout(p)`` layers drop elements with masks that are a function of (a seed drawn
        from ``mgpu.random`` once per step, the layer's place in the model, the example's row in
        X, the element's index in the example), so a batch gets the same masks on any number
        of devices and ranks and with any ``accumulate``, and ``deterministic`` keeps its
        promise; ``mgpu.random.seed`` repeats them and a resumed checkpoint (which saves the
        generator's state) continues them.

        ``comm_dtype="bf16"`` all-reduces the gradients in bfloat16, half the bytes of the
        default float32 (``mgpu._core._collective_counts()`` counts them): each replica's
        gradients (each logical shard's, deterministic) are rounded to bfloat16 (to nearest,
        ties to even) before they are sent, summed in float32 in the order the float32 step
        sums (device order; deterministic: the shard tree, each partial sum rounded to bfloat16
        as it is formed), and the sum is rounded to bfloat16 once more, as an all-gather in
        bfloat16 carries it; the optimizer updates the float32 parameters with it. So
        ``deterministic`` keeps the same bits on any device count. The same rounding and order
        hold for CPU devices' shared update and their bucketed all-reduce
        (``MGPU_CPU_SHARED_UPDATE=0``: the same bits), and across mpirun's ranks (bfloat16 bits
        sent as MPI_UINT16_T, rank order; with several devices per rank each rank's sum is
        rounded before the ranks add them; ``algorithm="mpi"`` rounds every partial sum of MPI's
        order). GPUs reduce on NCCL as ``ncclBfloat16`` (packed in bfloat16
        on each GPU, widened back after the sum; real NCCL rounds each partial sum in its own
        order, the same bits on 2 GPUs; ``MGPU_ALLREDUCE=peer``'s peer copies sum as CPU devices
        do), across ranks as ``ncclBfloat16`` too, or staged through host memory
        (``MGPU_DIST_GPU=host``) as CPU devices are.
        """
        shards = shard_count(deterministic, "train_step")
        accumulate = check_accumulate(accumulate, shards, "train_step")
        precision = check_precision(precision, "train_step: precision")
        comm_dtype = check_comm_dtype(comm_dtype, "train_step: comm_dtype")
        if not isinstance(loss, nn_CrossEntropyLoss) or loss.reduction != "mean":
            raise ValueError("train_step: the fused step computes nn.CrossEntropyLoss() (mean); "
                             f"got {loss!r}")
        max_norm = None if clip_grad_norm is None else check_max_norm(
            clip_grad_norm, "train_step", "clip_grad_norm")
        return self.run_step(X, y, trainer, shards, accumulate, precision, comm_dtype, max_norm)

    @_trace.span("DataParallel.train_step")  # the step's span, whichever entry called it
    def run_step(self, X: Tensor, y: Tensor, trainer, shards: int, accumulate: int,
                 precision: str, comm_dtype: str, max_norm: Optional[float]) -> Tensor:
        """:meth:`train_step` on arguments checked already, by it or once per run by a loop
        (``chapter.train_concise``): ``shards`` from ``shard_count``, ``accumulate`` from
        ``check_accumulate``, canonical ``precision``/``comm_dtype``, ``max_norm`` None or from
        ``check_max_norm``. The trainer's groups are still read and checked at every step."""
        if not self._sync:
            raise ValueError("train_step: called inside no_sync(); the fused step accumulates "
                             "within one call: net.train_step(X, y, loss, trainer, "
                             "accumulate=K) with the whole batch")
        opts = self._optimizer_options(trainer, max_norm)
        opts["comm_dtype"] = comm_dtype
        master = list(self.module.parameters())
        if [id(p) for p in trainer.params] != [id(p) for p in master]:
            raise ValueError("train_step: trainer must hold exactly this network's parameters, "
                             "in order (optim.SGD(net.parameters(), ...), or parameter groups "
                             "that list them in net.parameters()' order)")
        X, y = check_input(X, "train_step"), check_input(y, "train_step")
        self._check_master()
        fused = self._fused_model(precision)
        with fused.allocations, autograd.no_grad():
            fused.refresh_replicas()  # replicas start from the master
            # The optimizer's state lists: 1 (SGD's momentum), 2 (Adam's m, v), 3 (amsgrad's too).
            kinds = (1 if opts["momentum"] != 0 else 0) if opts["optimizer"] == "sgd" else (
                3 if opts["amsgrad"] else 2)
            if kinds:
                fused.state_in(trainer, kinds)
            # One draw per step, on every rank alike (each rank's generator is seeded the same).
            seed = _random.step_seed() if fused.dropout else 0
            losses = fused.model.run_step(X, y, shards=shards, accumulate=accumulate, seed=seed,
                                          **opts)
            fused.note_step()
            if kinds:
                fused.state_out(trainer, kinds, opts["step"])
            total = losses[0]
            for part in losses[1:]:
                total = total + part.to(total.device)
            return total / X.shape[0]

    @staticmethod
    def _optimizer_options(trainer, max_norm: Optional[float]) -> dict:
        """The fused step's optimizer arguments, read from ``trainer``'s parameter groups now
        and checked there (``Optimizer.current_groups``, the one check on this path: a value a
        scheduler or the user wrote is caught before the step, and the C++ step trusts it);
        raises for what the fused step does not do."""
        if not isinstance(trainer, (optim_SGD, optim_Adam)):
            raise TypeError(f"train_step: trainer must be mgpu.optim.SGD, Adam or AdamW, got "
                            f"{type(trainer).__name__}")
        groups = trainer.current_groups("train_step")
        # FusedModel.run_step's arguments; those of the other optimizer keep these values.
        opts: dict = {"momentum": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "step": 1,
                      "max_norm": max_norm, "lrs": [], "weight_decays": [], "amsgrad": False}
        if isinstance(trainer, optim_SGD):
            if any(g["dampening"] or g["nesterov"] for g in groups):
                raise ValueError("train_step: the fused step takes SGD's lr, momentum and "
                                 "weight_decay; dampening and nesterov need the book's loop")
            if len({g["momentum"] for g in groups}) > 1:
                raise ValueError("train_step: the fused step takes one momentum for every "
                                 "parameter group; groups with different momentum need the "
                                 "book's loop")
            opts.update(optimizer="sgd", momentum=groups[0]["momentum"])
        else:
            if len({(tuple(g["betas"]), g["eps"], g["amsgrad"]) for g in groups}) > 1:
                raise ValueError("train_step: the fused step takes one (betas, eps, amsgrad) for "
                                 "every parameter group; groups with different ones need the "
                                 "book's loop")
            steps = set(trainer._steps())
            if len(steps) > 1:
                raise ValueError(f"train_step: the fused step needs every parameter at the same "
                                 f"Adam step, got steps {sorted(steps)} (parameters that had no "
                                 "gradient in the book's loop were not stepped)")
            opts.update(optimizer="adamw" if trainer._decoupled else "adam",
                        betas=tuple(groups[0]["betas"]), eps=groups[0]["eps"],
                        amsgrad=groups[0]["amsgrad"], step=steps.pop() + 1)
        per = [(g["lr"], g["weight_decay"]) for g in groups for _ in g["params"]]
        opts["lr"], opts["weight_decay"] = per[0]
        if len(set(per)) > 1:
            opts["lrs"] = [lr for lr, _ in per]
            opts["weight_decays"] = [wd for _, wd in per]
        return opts

    def _fused_model(self, precision: str = "float32") -> "_Fused":
        """The fused model of this module tree, built again when the tree, its parameters,
        the precision or the memory of a parameter or buffer it was built on changed."""
        key = (self._tree, tuple(id(p) for p in self.module.parameters()), precision)
        fused = self.__dict__.get("_fused")
        if fused is None or fused.key != key or not fused.on_current_memory():
            self._replica_roots(1)  # refreshes self._tree
            key = (self._tree, tuple(id(p) for p in self.module.parameters()), precision)
            fused = _Fused(self.module, self.device_ids, key, precision)
            object.__setattr__(self, "_fused", fused)
        return fused


class _Fused:
    """The module tree as a layer list for ``mgpu._core.Model`` (via ``parallel.FusedModel``)."""

    def __init__(self, module: Module, devices: List[Device], key, precision: str = "float32"):
        self.key = key
        params = list(module.parameters())
        built = SpecBuilder(params, bf16=precision == "bf16")
        built.emit(module, 0)
        self.spec, bufs = built.spec, built.buffers
        self.dropout = built.dropout  # each step draws a seed for the dropout layers' masks
        self.replica_params = [params] + [[p.copyto(d) for p in params] for d in devices[1:]]
        self.replica_buffers = [bufs] + [[b.copyto(d) for b in bufs] for d in devices[1:]]
        self.model = FusedModel(self.spec, self.replica_params, self.replica_buffers, devices)
        # The master's tensors and the memory handles the C++ model holds for replica 0.
        self._held = [(t, t._t) for t in params + bufs]
        self.allocations = SteadyAllocations()  # the CPU allocator's warm-up over the steps
        # The trainer and its state buffers (with their storage versions) as the last step
        # left them: while they are unchanged, the replicas' own buffers are current.
        self._handed: Optional[Tuple[object, List[Optional[Tensor]], List[int]]] = None
        # The master's parameters (replica 0's) and their versions as the last fused step left
        # them, every replica's equal to them; None: copy them all.
        self._seen: Optional[List[int]] = None

    def on_current_memory(self) -> bool:
        """Whether every master parameter and buffer still holds the memory this model was
        built on. ``Module.to`` gives a tensor it moves new memory, even when a second move
        brings it back (``net.to(other); net.to(home)``): a model on the old memory would train
        copies the user's module no longer holds, so such a model is built again."""
        return all(t._t is handle for t, handle in self._held)

    def refresh_replicas(self) -> None:
        """Copies into the other replicas each master parameter that may have changed since
        the last fused step left every replica equal to the master.

        The rule: a parameter is copied unless its version is the one that step left and its
        memory is not shared with another library. Every writer of a master parameter in mgpu
        moves its version: the optimizers' steps, in-place tensor ops (``+=``, ``t[:] = u``,
        ``zero_``, ``fill_``, ``copyto``), ``nn.init``, ``load_state_dict`` (so a checkpoint's
        resume), ``allreduce`` and ``distributed.broadcast``, and this step; mgpu tensors have
        no ``.data`` to assign, and ``numpy()`` is a copy. A DLPack consumer of an exported
        tensor, or the owner of imported memory, writes without moving it: such memory
        (``_core.Tensor.exposed``) is copied at every step, since a stale replica would be a
        silent wrong answer. The C++ step leaves the replicas' parameters equal (each replica
        updates itself with the same sums), so in the steady state nothing is copied here.

        Batch norm's running statistics are not copied: a training step never reads the other
        replicas' (batch norm normalises with the batch's statistics), and its end copies
        replica 0's, the master's, over them (``share_buffers`` in C++), the one copy."""
        devices = len(self.replica_params)
        seen, self._seen = self._seen, None  # None until a step leaves the replicas equal
        masters = self.replica_params[0]
        for j, src in enumerate(masters):
            if seen is not None and seen[j] == src._t.version and not src._t.exposed:
                continue
            for r in range(1, devices):
                _core.copy(self.replica_params[r][j]._t, src._t)

    def note_step(self) -> None:
        """Records the master's versions after a fused step that left every replica equal."""
        self._seen = [p._t.version for p in self.replica_params[0]]

    @staticmethod
    def _trainer_state(trainer, kinds: int) -> List[Optional[Tensor]]:
        """The trainer's state lists, ``kinds`` of them (1: SGD's momentum; 2: Adam's m, v; 3:
        and amsgrad's maxima), concatenated."""
        if kinds == 1:
            return trainer._momentum_list()
        return [b for which in trainer._moment_lists(kinds == 3) for b in which]

    def state_in(self, trainer, kinds: int) -> None:
        """Copies ``trainer``'s momentum buffers (SGD) or moments (Adam; ``kinds`` as
        ``_trainer_state``) into every replica unless they are the views the last fused step
        handed out, unchanged since."""
        current = self._trainer_state(trainer, kinds)
        h = self._handed
        if h is not None and h[0] is trainer and len(h[1]) == len(current) and all(
                a is b and (a is None or a._t.version == v)
                for a, b, v in zip(current, h[1], h[2])):
            return
        n = len(self.replica_params[0])
        for r in range(len(self.replica_params)):
            for which in range(kinds):
                self.model.set_momentum_buffers(current[which * n:(which + 1) * n], r, which)

    def state_out(self, trainer, kinds: int, step: int) -> None:
        """Hands replica 0's buffers (views, updated by every fused step) to trainer."""
        lists = [self.model.momentum_buffers(0, which) for which in range(kinds)]
        if kinds == 1:
            trainer._set_momentum_list(lists[0])
        else:
            trainer._set_moments(*lists[:2], step, lists[2] if kinds == 3 else None)
        views = [b for which in lists for b in which]
        self._handed = (trainer, views, [b._t.version for b in views])


# --- synchronised batch norm ---------------------------------------------------------------

class _PeerFailed(RuntimeError):
    """Raised in replicas whose peer failed, so the peer's own error is the one reported."""


class _SyncGroup:
    """Where the replicas' threads meet at every SyncBatchNorm layer (same order in each)."""

    def __init__(self, k: int):
        self.k = k
        self.barrier = threading.Barrier(k)
        self.slots: List[object] = [None] * k
        self.result: Optional[List[Tensor]] = None
        self.error: Optional[BaseException] = None

    def _wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise _PeerFailed("SyncBatchNorm: another replica failed") from None

    def exchange(self, rank: int, item, compute) -> Tensor:
        self.slots[rank] = item
        self._wait()
        if rank == 0:
            self.error, self.result = None, None
            try:
                self.result = compute(list(self.slots))
            except BaseException as e:  # reported by rank 0, the others stop with _PeerFailed
                self.error = e
        self._wait()
        if self.error is not None:
            if rank == 0:
                raise self.error
            raise _PeerFailed("SyncBatchNorm: the synchronised statistics failed")
        return self.result[rank]


def _run_synced(roots: List[Module], shards: List[Tensor]) -> List[Tensor]:
    """Runs replica i on shard i, each in its own thread (replica 0 in this one), so that they
    can meet at every SyncBatchNorm layer."""
    k = len(roots)
    group = _SyncGroup(k)
    for rank, root in enumerate(roots):
        for m in root.modules():
            if isinstance(m, SyncBatchNorm):
                m.__dict__["_sync_group"], m.__dict__["_sync_rank"] = group, rank
    outs: List[Optional[Tensor]] = [None] * k
    errors: List[Optional[BaseException]] = [None] * k
    recording = autograd.is_recording()

    def run(rank: int) -> None:
        depth = getattr(module_calls, "depth", 0)
        module_calls.depth = 1  # nested in DataParallel's call (which restores on error)
        try:
            with autograd.set_grad_enabled(recording):
                outs[rank] = roots[rank](shards[rank])
        except BaseException as e:
            errors[rank] = e
            group.barrier.abort()
        finally:
            module_calls.depth = depth

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, k)]
    try:
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
    finally:
        for root in roots:
            for m in root.modules():
                m.__dict__.pop("_sync_group", None)
                m.__dict__.pop("_sync_rank", None)
    real = [e for e in errors if e is not None and not isinstance(e, _PeerFailed)]
    if real:
        raise real[0]
    if any(e is not None for e in errors):
        raise next(e for e in errors if e is not None)
    return outs  # type: ignore[return-value]


class _Parts:
    """The gradient of a joint multi-device op's output: one tensor per replica (autograd sums
    these with +, so each replica's output contributes its own slot)."""

    __slots__ = ("by_rank",)

    def __init__(self, by_rank: Dict[int, Tensor]):
        self.by_rank = by_rank

    def __add__(self, other: "_Parts") -> "_Parts":
        merged = dict(self.by_rank)
        for r, g in other.by_rank.items():
            merged[r] = merged[r] + g if r in merged else g
        return _Parts(merged)


def _h(t: Optional[Tensor]):
    return None if t is None else t._t


def _sync_batch_norm(items, master: "SyncBatchNorm", momentum: float) -> List[Tensor]:
    """Batch norm of k shards with the statistics of their union, as one recorded op.

    The shards' (mean, biased var, count) are combined exactly (Chan et al.'s parallel
    formula: mean = sum n_i m_i / n, var = sum n_i (v_i + (m_i - mean)^2) / n, in double, by
    ``_core.batch_norm_combine_stats`` as the fused step combines them); backward adds the
    shards' sum(dy) and sum(dy * xhat) the same way (in double, shards in order, by
    ``_core.batch_norm_combine_sums``) and uses the global count, so k devices compute what one
    device computes on the whole batch, with the fused step's bits.
    """
    xs = [it[0] for it in items]
    ws = [it[1] for it in items]
    bs = [it[2] for it in items]
    d0 = xs[0].device
    C = master.num_features
    counts = [x.size // C for x in xs]
    n = sum(counts)
    if n <= 1:
        raise ValueError(f"SyncBatchNorm: training needs more than one value per channel over "
                         f"all replicas, got {n}")
    eps = master.eps
    with autograd.no_grad():
        # Combined in double on d0 by the op the fused step's synchronised layer runs.
        local = [_core.batch_norm_stats(x._t) for x in xs]
        mean, var = (Tensor(t) for t in _core.batch_norm_combine_stats(
            [m for m, _ in local], [v for _, v in local], [float(c) for c in counts], d0))
        if master.training and master.track_running_stats:
            for running, batch, step in ((master.running_mean, mean, momentum),
                                         (master.running_var, var, momentum * n / (n - 1))):
                _core.batch_norm_update_running(running._t, batch._t, 1.0 - momentum, step)
                running._t.bump_version()
        means = [mean.to(x.device) for x in xs]
        variances = [var.to(x.device) for x in xs]
    ys = [Tensor(_core.batch_norm_forward(x._t, m._t, v._t, _h(w), _h(b), eps))
          for x, m, v, w, b in zip(xs, means, variances, ws, bs)]
    inputs = xs + ws + bs
    if not (autograd.is_recording() and any(t is not None and t.requires_grad for t in inputs)):
        return ys
    k = len(xs)

    def backward(parts: _Parts):
        dys = [parts.by_rank.get(i) if parts.by_rank.get(i) is not None else zeros_like(ys[i])
               for i in range(k)]
        sums = [_core.batch_norm_backward_reduce(x._t, dy._t, m._t, v._t, eps)
                for x, dy, m, v in zip(xs, dys, means, variances)]
        # Added on d0 in double, replicas in order, by the op the fused step's synchronised
        # layer runs, and the totals copied to every replica's device.
        all_dy, all_dy_xhat = _core.batch_norm_combine_sums(
            [s for s, _ in sums], [sx for _, sx in sums], d0)
        total = [(_core.to_device(all_dy, x.device), _core.to_device(all_dy_xhat, x.device))
                 for x in xs]
        dxs = [Tensor(_core.batch_norm_backward(x._t, dy._t, m._t, v._t, _h(w), tot[0], tot[1],
                                                float(n), eps, True))
               if x.requires_grad else None
               for x, dy, m, v, w, tot in zip(xs, dys, means, variances, ws, total)]
        dws = [Tensor(sx) if w is not None and w.requires_grad else None
               for (_, sx), w in zip(sums, ws)]
        dbs = [Tensor(s) if b is not None and b.requires_grad else None
               for (s, _), b in zip(sums, bs)]
        return tuple(dxs + dws + dbs)

    joint = Tensor(_core.Tensor.empty([], "float32", d0))
    autograd.attach(joint, inputs, backward)

    def select(i: int):
        return lambda dy: (_Parts({i: dy}),)

    return [autograd.attach(y, [joint], select(i)) for i, y in enumerate(ys)]


class SyncBatchNorm(BatchNormBase):
    """Batch norm whose statistics, under ``DataParallel`` in training, are those of the whole
    batch across all replicas (so k devices compute what one device does on the whole batch).
    Alone, or in evaluation, it is ``BatchNorm2d``. Inputs (N, C, H, W) or (N, C)."""

    _dims = (2, 4)

    def forward(self, x: Tensor) -> Tensor:
        group: Optional[_SyncGroup] = self.__dict__.get("_sync_group")
        if group is None or not self.training or group.k == 1:
            return super().forward(x)
        x = self._check(x)
        rank = self.__dict__["_sync_rank"]
        momentum = self._momentum_now() if self.track_running_stats else 0.0
        return group.exchange(rank, (x, self.weight, self.bias),
                              lambda items: _sync_batch_norm(items, self, momentum))

    @classmethod
    def convert_sync_batchnorm(cls, module: Module) -> Module:
        """Replaces every BatchNorm layer of ``module`` by a SyncBatchNorm sharing its
        parameters and running statistics; returns the converted module (``module`` itself
        unless it is a BatchNorm layer)."""
        if not isinstance(module, Module):
            raise TypeError(f"convert_sync_batchnorm: expected an mgpu.nn.Module, got "
                            f"{type(module).__name__}")
        out = module
        if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, device=module.running_mean.device
                      if module.running_mean is not None else None)
            for store in ("_parameters", "_buffers"):
                out.__dict__[store] = OrderedDict(module.__dict__[store])
            out.__dict__["training"] = module.training
        for name, child in module._modules.items():
            if child is not None:
                out._modules[name] = cls.convert_sync_batchnorm(child)
        return out


@emits(SyncBatchNorm, exact=True, condition=BATCH_NORM_CONDITION)
def _sync_batch_norm_layer(b: SpecBuilder, m: SyncBatchNorm, src: int) -> Optional[int]:
    return batch_norm(b, m, src, sync=True)


# PyTorch's spelling, nn.DataParallel and nn.SyncBatchNorm: this module, a floor above mgpu.nn,
# adds them there (mgpu imports this module, so they are in nn once mgpu is imported).
nn.DataParallel, nn.SyncBatchNorm = DataParallel, SyncBatchNorm
nn.__all__ += ["DataParallel", "SyncBatchNorm"]
