"""The chapters' own multi-device code, nearly line for line, on mgpu.

Sec. 12.5.4-12.5.6 op by op: Python loops over devices, autograd records each op, the naive
allreduce copies everything through device 0 (mgpu's fused ``train_batch`` must compute the same
step; the tests run both and compare). Sec. 12.6's ``train`` is ``train_concise``: modules,
``nn.DataParallel``, ``optim.SGD``.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from . import amp, nn, optim, random
from . import distributed as _dist
from . import loop as _scaffold
from .autograd import no_grad
from .checkpoint import CheckpointError, check_run
from .data import load_data_fashion_mnist
from .device import try_gpu
from .loop import Timer, TrainResult
from .models import lenet
from .nn import CrossEntropyLoss
from .nn_utils import check_max_norm, clip_grads
from .optim.lr_scheduler import make_schedule
from .parallel import check_accumulate, sgd, shard_count, split_batch
from .tensor import zeros_like
from .train import evaluate_accuracy_gpu, train

loss = CrossEntropyLoss(reduction="none")


def allreduce(data):
    """Sums ``data`` (one tensor per device) into data[0], then copies it back everywhere."""
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)


def train_batch(X, y, device_params, devices, lr):
    """One data-parallel step written op by op, as the chapter writes it."""
    X_shards, y_shards = split_batch(X, y, devices)
    # Loss is calculated separately on each device
    ls = [loss(lenet(X_shard, device_W), y_shard).sum()
          for X_shard, y_shard, device_W in zip(X_shards, y_shards, device_params)]
    for l in ls:  # Backpropagation is performed separately on each device
        l.backward()
    # Sum all gradients from each device and broadcast them to all devices
    with no_grad():
        for i in range(len(device_params[0])):
            allreduce([device_params[c][i].grad for c in range(len(devices))])
    # The model parameters are updated separately on each device
    for param in device_params:
        sgd(param, lr, X.shape[0])  # Here, we use a full-size batch


def _tree_split(lo: int, hi: int) -> int:
    """The deterministic step's tree (cpp/train/shard_tree.h): node [lo, hi) splits after the
    largest power of two below hi - lo."""
    p = 1
    while 2 * p < hi - lo:
        p *= 2
    return lo + p


def _ranges(n: int, k: int):
    base, extra = divmod(n, k)
    out, at = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def train_batch_sharded(X, y, device_params, devices, lr, shards: int = 8):
    """The chapter's step op by op, in the deterministic step's order: the batch cut into
    ``shards`` logical shards, device d taking a contiguous run of them, each shard's loss and
    gradients through autograd on its device, the shard gradients added in the fixed tree, and
    every replica updated with the same sum. Every device count gives the same bits, and they
    are the bits of the fused ``train_batch(..., deterministic=shards)``: its kernels add in the
    order of these ops, and the tree is the same."""
    rows = _ranges(X.shape[0], shards)
    owner = [d for d, (a, b) in enumerate(_ranges(shards, len(devices))) for _ in range(a, b)]
    def leaf(s):
        d, (lo, hi) = owner[s], rows[s]
        W = device_params[d]
        if hi == lo:  # an empty shard adds zero gradients
            return [zeros_like(p) for p in W]
        for p in W:
            p.grad.zero_()
        loss(lenet(X[lo:hi].to(devices[d]), W), y[lo:hi].to(devices[d])).sum().backward()
        return [p.grad.copyto(p.device) for p in W]

    def node(lo, hi):
        if hi - lo == 1:
            return leaf(lo)
        mid = _tree_split(lo, hi)
        left, right = node(lo, mid), node(mid, hi)
        with no_grad():
            for a, b in zip(left, right):
                a[:] += b.to(a.device)
        return left

    total = node(0, shards)
    for param in device_params:
        with no_grad():
            for p, g in zip(param, total):
                p.grad[:] = g.to(p.device)
        sgd(param, lr, X.shape[0])


def train_op_by_op(num_gpus: int, batch_size: int, lr: float, num_epochs: int = 10,
                   deterministic=False, **kw) -> TrainResult:
    """``train`` with the chapter's Python-level train_batch (autograd, op by op); with
    ``deterministic`` its variant in the deterministic step's shards and tree
    (``chapter.train_batch_sharded``), bitwise the fused deterministic training."""
    shards = shard_count(deterministic, "train_op_by_op")
    _dist.auto_init()
    if _dist.world_size() > 1:
        raise ValueError("train_op_by_op: the chapter's op-by-op step runs in one process; under "
                         "mpirun use the fused train (drop --op-by-op)")
    step = train_batch
    if shards:
        def step(X, y, device_params, devices, lr):
            return train_batch_sharded(X, y, device_params, devices, lr, shards)
    return train(num_gpus, batch_size, lr, num_epochs, step=step, **kw)


# --- sec. 12.6, the concise implementation ------------------------------------------------------

OPTIMIZERS = ("sgd", "adam", "adamw")


def make_optimizer(params, lr: float, optimizer: str = "sgd",
                   weight_decay: Optional[float] = None):
    """``optim.SGD`` (the book's, no momentum), ``optim.Adam`` or ``optim.AdamW`` over
    ``params`` with ``lr``; ``weight_decay`` None keeps the optimizer's default (0, 0, 0.01)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    kw = {} if weight_decay is None else {"weight_decay": weight_decay}
    cls = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}[optimizer]
    return cls(params, lr=lr, **kw)


def train_concise(net, num_gpus: int, batch_size: int, lr: float, num_epochs: int = 10,
                  data=None, data_dir: Optional[str] = None,
                  limit_batches: Optional[int] = None, seed: int = 0,
                  progress: Optional[bool] = None, fused: bool = False,
                  deterministic=False, checkpoint: Optional[str] = None,
                  checkpoint_every: Optional[int] = None, resume: bool = False,
                  optimizer: str = "sgd", weight_decay: Optional[float] = None,
                  schedule: str = "none", warmup_epochs: int = 0,
                  clip_grad_norm: Optional[float] = None, accumulate: int = 1,
                  log: Optional[str] = None, tensorboard: Optional[str] = None,
                  precision: str = "float32", comm_dtype: str = "float32") -> TrainResult:
    """The concise chapter's ``train(net, num_gpus, batch_size, lr)`` (sec. 12.6), as printed:
    ``normal_(std=0.01)`` init of Linear and Conv2d weights, ``nn.DataParallel``, SGD and the
    mean cross-entropy, the book's loop, test accuracy on all devices after every epoch, and
    its line ``test acc: 0.91, 5.7 sec/epoch on [gpu(0), gpu(1)]``.

    ``data`` is a (train_iter, test_iter) pair to use instead of Fashion-MNIST, ``limit_batches``
    shortens every epoch (and the evaluation), ``seed`` fixes the initial weights and shuffles.
    ``fused=True`` replaces the loop's body by ``net.train_step(X, y, loss, trainer)``, the same
    step in one C++ call; ``deterministic=True`` (with ``fused``) makes that step's result the
    same bits on any number of devices (``DataParallel.train_step``). ``checkpoint``,
    ``checkpoint_every`` and ``resume`` save and resume the run as in ``mgpu.train``
    (parameters, BatchNorm buffers, the optimizer's state, the schedule's position, data order
    and position, RNG, step).

    Beyond the book: ``optimizer`` 'sgd' (the book's), 'adam' or 'adamw' with ``weight_decay``
    (see :func:`make_optimizer`), ``schedule`` 'none', 'step', 'cosine' or 'onecycle' with
    ``warmup_epochs`` (see ``optim.lr_scheduler.make_schedule``, stepped after every batch), and
    ``clip_grad_norm``: the gradients' global norm clipped to it before every update
    (``nn.utils.clip_grad_norm_`` in the book's loop, inside the C++ step when fused).
    ``accumulate=K``: gradient accumulation, one optimizer update per batch from K
    micro-batches of batch_size / K run one after another (the book's loop: K forward and
    backward passes, all but the last under ``net.no_sync()``, each loss scaled by its share of
    the batch; fused: ``train_step(..., accumulate=K)``); a step is still one batch and one
    update, so schedules and checkpoints count as without it.
    ``log`` (JSON lines) and ``tensorboard`` (event files) record every step's loss, lr and
    images/s and every epoch's accuracy, as in ``mgpu.train``; SIGTERM or SIGUSR1 stops the run
    after the current step with a checkpoint and ``mgpu.Preempted`` (see ``mgpu.loop``).
    ``precision="bf16"``: the convolutions and linear layers train with bfloat16 products and
    float32 sums (the loop's forward under ``mgpu.autocast("bf16")``, or the fused step's
    ``precision``), with or without ``accumulate``; the evaluation stays float32. On CPUs the
    convolutions whose float32 kernels are faster (ResNet-18's 3x3 stride-1 layers: Winograd
    F(4x4, 3x3)) run those on bfloat16-rounded operands, so a bf16 epoch takes about as long as
    a float32 one, not yet less.
    ``comm_dtype="bf16"`` (with ``fused``): the gradients are all-reduced in bfloat16, half the
    bytes (``DataParallel.train_step``'s ``comm_dtype``); a checkpoint records it and a resume
    with another is refused, as it would not end with the uninterrupted run's parameters.
    Returns the per-epoch accuracies and times.
    """
    if int(num_gpus) < 1:
        raise ValueError(f"train_concise: num_gpus must be >= 1, got {num_gpus}")
    precision = amp.check_precision(precision, "train_concise: precision")
    comm_dtype = amp.check_comm_dtype(comm_dtype, "train_concise: comm_dtype")
    if comm_dtype != "float32" and not fused:
        raise ValueError("train_concise: comm_dtype='bf16' needs fused=True (the book's loop "
                         "sums its gradients through autograd, in float32)")
    # deterministic is resolved here, once: everything below gets the shard count.
    shards = shard_count(deterministic, "train_concise")
    if shards and not fused:
        raise ValueError("train_concise: deterministic needs fused=True (the book's loop through "
                         "autograd sums gradients in device order)")
    ckpts = _scaffold.open_checkpoints(checkpoint, checkpoint_every, resume, "train_concise")
    accumulate = check_accumulate(accumulate, shards, "train_concise")
    random.seed(seed)
    train_iter, test_iter = data if data is not None else load_data_fashion_mnist(
        batch_size, data_dir=data_dir, seed=seed, limit_batches=limit_batches)
    if ckpts is not None:
        _scaffold.check_resumable_loader(train_iter, "train_concise")
    devices = [try_gpu(i) for i in range(num_gpus)]

    def init_weights(module):
        if type(module) in [nn.Linear, nn.Conv2d]:
            nn.init.normal_(module.weight, std=0.01)

    net.apply(init_weights)
    # Set the model on multiple GPUs
    net = nn.DataParallel(net, device_ids=devices)
    trainer = make_optimizer(net.parameters(), lr, optimizer, weight_decay)
    scheduler = make_schedule(trainer, schedule, int(num_epochs),
                              len(train_iter) if schedule != "none" or warmup_epochs else 0,
                              warmup_epochs)
    # Checked once, here; every step below takes the checked value (run_step, clip_grads).
    max_norm = None if clip_grad_norm is None else check_max_norm(
        clip_grad_norm, "train_concise", "clip_grad_norm")
    loss = nn.CrossEntropyLoss()
    result = TrainResult(devices=devices)
    config = {"batch_size": batch_size, "num_devices": len(devices), "world_size": 1,
              "lr": lr, "seed": seed, "fused": bool(fused), "deterministic": shards,
              "optimizer": optimizer, "schedule": schedule, "warmup_epochs": warmup_epochs,
              "clip_grad_norm": clip_grad_norm, "accumulate": accumulate,
              "precision": precision, "comm_dtype": comm_dtype}

    def state():
        return {"model": net.module.state_dict(), "optimizer": trainer.state_dict(),
                "epoch_losses": np.array(loop.run.losses, dtype=np.float32)}

    loop = _scaffold.Loop("train_concise", "mgpu.train_concise", num_epochs, train_iter, result,
                          ckpts, Timer(), config, scheduler, state, log=log,
                          tensorboard=tensorboard, progress=progress)
    with loop:  # SIGTERM and SIGUSR1 handled from here (mgpu.loop)
        run = loop.start(resume, lambda path, saved: _resume_concise(
            path, saved, net.module, trainer, train_iter, result, batch_size, len(devices), fused,
            shards, scheduler, accumulate, comm_dtype))
        for epoch in loop.epochs():
            net.train()
            losses = run.losses
            for X, y in train_iter:
                step_lr = trainer.param_groups[0]["lr"]
                if fused:  # net.train_step(X, y, loss, trainer, ...) on the checked arguments
                    l = net.run_step(X, y, trainer, shards, accumulate, precision, comm_dtype,
                                     max_norm)
                else:
                    trainer.zero_grad()
                    X, y = X.to(devices[0]), y.to(devices[0])
                    with amp.autocast(precision):  # each backward runs with its forward's
                        if accumulate == 1:
                            l = loss(net(X), y)
                            l.backward()
                        else:
                            l = accumulated_backward(net, loss, X, y, accumulate)
                    if max_norm is not None:  # nn.utils.clip_grad_norm_, checked above
                        clip_grads(net.parameters(), max_norm)
                    trainer.step()
                if scheduler is not None:
                    scheduler.step()
                losses.append(l.detach())
                loop.step_done(epoch, step_lr, X.shape[0], [losses[-1]], 1)
            loop.end_epoch()
            result.train_loss.append(float(np.mean([_scaffold.host_value(v) for v in losses]))
                                     if losses else float("nan"))
            result.test_acc.append(evaluate_accuracy_gpu(net, test_iter))
            loop.epoch_done(epoch)
    # Every epoch's time, those before a resume included (the timer holds this session's).
    loop.finish()
    return result


def accumulated_backward(net, loss, X, y, accumulate: int):
    """The book's loop with gradient accumulation: X, y split into ``accumulate`` micro-batches
    (sizes differ by at most one; empty ones skipped), each one's forward and backward in turn,
    all but the last under ``net.no_sync()`` (DataParallel's), each mean loss scaled by its
    share of the batch, so the gradients add up to those of the mean loss over X. Returns that
    loss (0-d, detached)."""
    n = X.shape[0]
    parts = [(a, b) for a, b in _ranges(n, accumulate) if b > a]
    total = None
    for i, (a, b) in enumerate(parts):
        quiet = net.no_sync() if i + 1 < len(parts) else contextlib.nullcontext()
        with quiet:
            share = loss(net(X[a:b]), y[a:b]) * ((b - a) / n)
            share.backward()
        total = share.detach() if total is None else total + share.detach()
    return total


def _resume_concise(path: str, state, module, trainer, train_iter, result: TrainResult,
                    batch_size: int, num_devices: int, fused: bool, shards: int,
                    scheduler=None, accumulate: int = 1,
                    comm_dtype: str = "float32") -> "_scaffold.Progress":
    """Puts a checkpoint's state into the run: everything is checked before anything changes."""
    check_run(path, state, "mgpu.train_concise", batch_size, num_devices, 1, shards)
    saved_comm = state.get("config", {}).get("comm_dtype", "float32")
    if saved_comm != comm_dtype:
        raise CheckpointError(path, f"was written by a run with comm_dtype={saved_comm!r}, this "
                              f"run has comm_dtype={comm_dtype!r} (the gradients' rounding "
                              "changes the steps, so the run would not end where the "
                              "uninterrupted one does); resume with the same --comm-dtype")
    saved_accumulate = state.get("config", {}).get("accumulate", 1)
    if saved_accumulate != accumulate:
        raise CheckpointError(path, f"was written by a run with accumulate={saved_accumulate}, "
                              f"this run has accumulate={accumulate} (batch norm's running "
                              "statistics move once per micro-batch); resume with the same "
                              "--accumulate")
    saved_opt = state.get("config", {}).get("optimizer", "sgd")
    saved_sched = state.get("scheduler")
    if saved_opt != type(trainer).__name__.lower():
        raise CheckpointError(path, f"was written by a run with optimizer {saved_opt!r}, this "
                              f"run has {type(trainer).__name__.lower()!r}; resume with the "
                              "same optimizer")
    if (saved_sched is None) != (scheduler is None):
        raise CheckpointError(path, "was written by a run with " + (
            "no learning-rate schedule" if saved_sched is None else "a learning-rate schedule")
            + ", this run has " + ("none" if scheduler is None else "one")
            + "; resume with the same --schedule and --warmup-epochs")
    saved, mine = state["model"], module.state_dict()
    if not isinstance(saved, dict) or list(saved) != list(mine):
        names = list(saved) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(path, f"holds the state of another network (its entries "
                              f"{str(names)[:200]} differ from this network's "
                              f"{str(list(mine))[:200]})")
    for k, v in mine.items():
        if tuple(saved[k].shape) != tuple(v.shape):
            raise CheckpointError(path, f"'{k}' has shape {tuple(saved[k].shape)}, this "
                                  f"network's has {tuple(v.shape)}: it belongs to another network")
    opt = state["optimizer"]
    try:
        rng = random.generator_from_state(state["rng"])
        if len(opt["param_groups"][0]["params"]) != len(trainer.params):
            raise ValueError("its optimizer state is for another parameter count")
        params = trainer.params
        for i, entry in opt["state"].items():
            for name, t in entry.items():
                if hasattr(t, "shape") and np.ndim(t) and \
                        tuple(t.shape) != tuple(params[int(i)].shape):
                    raise ValueError(f"the {name} of parameter {i} has another shape than "
                                     f"the parameter")
        if scheduler is not None:
            probe = type(scheduler).__new__(type(scheduler))
            probe.__dict__ = dict(scheduler.__dict__)
            probe.load_state_dict(saved_sched)  # checks before it changes anything
        train_iter.load_state_dict(state["loader"])  # checks before it changes anything
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise CheckpointError(path, str(e)) from None
    # The fused step takes the restored state from the optimizer at its next step.
    trainer.load_state_dict(opt)
    if scheduler is not None:
        scheduler.load_state_dict(saved_sched)
    module.load_state_dict(saved)
    random.set_generator(rng)
    _scaffold.restore_result(result, state["result"])
    print(f"resuming from {path} (epoch {state['epoch'] + 1}, step {state['step']})")
    return _scaffold.Progress(epoch=int(state["epoch"]), step=int(state["step"]),
                    losses=[float(v) for v in state["epoch_losses"]],
                    elapsed=float(state["epoch_elapsed"]))
