"""The chapter's training loop (sec. 12.5.6) and accuracy on all devices (its last exercise).

``train(num_gpus, batch_size, lr)`` loads Fashion-MNIST, replicates LeNet on
``[try_gpu(i) for i in range(num_gpus)]``, runs the fused ``train_batch`` over every minibatch,
evaluates on all devices after each epoch, and prints the chapter's line
``test acc: 0.85, 3.1 sec/epoch on [cpu(0), cpu(1)]``. Under ``mpirun`` the same call trains one
process per device (see ``mgpu.distributed``): same global batches, same step, rank 0 prints.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import checkpoint as _checkpoint
from . import distributed as _dist
from . import random as _random
from . import trace as _trace
from .amp import autocast, check_precision
from .autograd import no_grad
from .data import DataLoader, load_data_fashion_mnist
from .device import Device, as_device, try_gpu
from .engine import core as _core
from .loop import (
    Loop,
    Progress,
    Timer,
    TrainResult,
    check_resumable_loader,
    host_value,
    in_notebook,
    open_checkpoints,
    restore_result,
)
from .models import lenet_params
from .nn import Module
from .parallel import (
    check_accumulate,
    check_batch_size,
    check_lr,
    evaluate_counts,
    get_params,
    run_batch,
    shard_count,
)
from .tensor import Tensor, array


@_trace.span("evaluate_accuracy")
def evaluate_accuracy(net_or_params, data_iter,
                      devices: Optional[Sequence[Device]] = None) -> float:
    """Test accuracy, computed on all ``devices`` at once.

    ``net_or_params`` is either one parameter list per device (LeNet replicas, as ``train`` keeps
    them; each batch is split over the devices) or a callable ``net(X) -> logits`` run on
    ``devices[0]`` (an ``nn.Module`` is put in eval mode and, without ``devices``, fed on its
    first parameter's device, as d2l's evaluate_accuracy_gpu does).
    """
    counts: List[Tensor] = []
    seen = 0
    if callable(net_or_params):
        device = as_device(devices[0]) if devices else None
        if isinstance(net_or_params, Module):
            net_or_params.eval()  # BatchNorm: running statistics (d2l's evaluate_accuracy_gpu)
            if device is None:
                first = next(iter(net_or_params.parameters()), None)
                device = first.device if first is not None else None
        with no_grad():  # evaluation needs no backward graph
            for X, y in data_iter:
                if device is not None:
                    X, y = X.to(device), y.to(device)
                counts.append(Tensor(_core.correct_count(net_or_params(X)._t, y._t)))
                seen += X.shape[0]
    else:
        if devices is None:
            devices = [ps[0].device for ps in net_or_params]
        for X, y in data_iter:
            counts.extend(evaluate_counts(X, y, net_or_params, devices))
            seen += X.shape[0]
    if seen == 0:
        raise ValueError("evaluate_accuracy: the data iterator yielded no examples")
    correct = sum(c.item() for c in counts)
    if not callable(net_or_params) and _dist.world_size() > 1:
        correct = _sum_over_ranks(correct)  # each rank counted its slice of every batch
    return correct / seen


def _sum_over_ranks(value: float) -> float:
    from .tensor import array
    t = array(np.array([value], dtype=np.float32))
    _dist.allreduce(t)
    return float(t.numpy()[0])


def evaluate_accuracy_gpu(net: Callable, data_iter, device: Optional[Device] = None) -> float:
    """d2l's name: accuracy of ``net`` on one device."""
    return evaluate_accuracy(net, data_iter, [device] if device is not None else None)


def train(num_gpus: int, batch_size: int, lr: float, num_epochs: int = 10,
          data_dir: Optional[str] = None, limit_batches: Optional[int] = None, seed: int = 0,
          params: Optional[Sequence[Tensor]] = None, progress: Optional[bool] = None,
          plot: Optional[bool] = None, data=None, step: Optional[Callable] = None,
          check_finite: bool = True, deterministic=False, checkpoint: Optional[str] = None,
          checkpoint_every: Optional[int] = None, resume: bool = False,
          schedule: str = "none", warmup_epochs: int = 0, accumulate: int = 1,
          log: Optional[str] = None, tensorboard: Optional[str] = None,
          precision: str = "float32") -> TrainResult:
    """Trains the chapter's LeNet data-parallel on ``num_gpus`` devices and prints its line.

    Devices are ``[try_gpu(i) for i in range(num_gpus)]``: GPUs where they exist, virtual CPU
    devices otherwise. ``limit_batches`` shortens every epoch (quick runs), ``seed`` fixes the
    initial parameters and the shuffles, ``params`` starts from given parameters instead,
    ``data`` is a (train_iter, test_iter) pair to use instead of Fashion-MNIST. ``progress``
    shows a progress bar (default: when stderr is a terminal); ``plot`` draws the accuracy curve
    (default: in a notebook). ``step(X, y, device_params, devices, lr)`` takes one minibatch
    step: mgpu's fused ``train_batch`` by default, or e.g. the chapter's own
    ``mgpu.chapter.train_batch``. ``check_finite`` stops training with FloatingPointError,
    naming the epoch and step, once a step's loss is NaN or infinite (checked at each epoch's end,
    where the losses are read anyway, so the check costs the step nothing; pass False to train on).
    ``deterministic=True`` (or a number of logical shards) trains with the fused step's
    deterministic mode: the same parameters, bit for bit, on any number of devices and processes.
    ``checkpoint`` is a directory where the run's state (parameters, the data order and
    position, the RNG, the step, the results so far) is saved every ``checkpoint_every`` steps
    and at each epoch's end (``mgpu.checkpoint``); with ``resume=True`` the run continues from
    the newest checkpoint there (or starts afresh if there is none) and ends with the very
    parameters an uninterrupted run would have, on the same devices. Under mpirun rank 0
    writes and every rank reads. ``schedule`` ('none', 'step', 'cosine', 'onecycle') and
    ``warmup_epochs`` change the lr after every batch (``optim.lr_scheduler.make_schedule``);
    each step gets the lr of the moment, and checkpoints keep the schedule's position.
    ``accumulate=K`` runs each batch as K micro-batches in the fused step, their gradients
    summed before one reduction and one update (``parallel.train_batch``); not with ``step``.
    ``log`` is a file of JSON lines (a record per step: loss, lr, images/s; one per epoch: test
    accuracy, loss, sec/epoch), ``tensorboard`` a directory of TensorBoard event files with the
    same values; see ``mgpu.loop`` for the format and for when the step losses are read.
    SIGTERM or SIGUSR1 ends the run after the current step, with a checkpoint when ``checkpoint``
    is set, by raising ``mgpu.Preempted`` (``mgpu.loop``); ``resume=True`` continues it.
    ``precision="bf16"`` trains with the fused step's bfloat16 products: both convolutions and
    both linear layers take bfloat16 operands and sum in float32, forward and backward
    (``parallel.train_batch``); bias, relu, pooling, the loss, the gradient sums and SGD stay
    float32, the parameters are float32 master weights, and the evaluation runs in float32. It
    works with ``deterministic`` (the same bits on any device count), ``accumulate`` and
    checkpoints (which record it; a resume with another precision is refused). A given ``step``
    runs under ``mgpu.autocast(precision)``: the chapter's op-by-op step then runs the same
    products and gives the fused step's bits.
    Returns the per-epoch accuracies, losses and times.
    """
    lr = check_lr(lr, "train")
    batch_size = check_batch_size(batch_size, "train")
    if int(num_gpus) < 1:
        raise ValueError(f"train: num_gpus must be >= 1, got {num_gpus}")
    if int(num_epochs) < 1:
        raise ValueError(f"train: num_epochs must be >= 1, got {num_epochs}")
    ckpts = open_checkpoints(checkpoint, checkpoint_every, resume, "train")
    shards = shard_count(deterministic, "train")
    if shards and step is not None:
        raise ValueError("train: deterministic is a mode of the fused train_batch; pass either "
                         "deterministic or step, not both")
    accumulate = check_accumulate(accumulate, shards, "train")
    precision = check_precision(precision, "train: precision")
    if precision != "float32" and step is not None:
        given = step

        def step(X, y, device_params, devices, lr):
            with autocast(precision):
                return given(X, y, device_params, devices, lr)
    if accumulate != 1 and step is not None:
        raise ValueError("train: accumulate is a mode of the fused train_batch; the chapter's "
                         "op-by-op step takes the whole batch (drop accumulate or step)")
    if step is None:
        # train_batch on the numbers checked above, once: each step takes them as they are.
        def step(X, y, device_params, devices, lr):
            return run_batch(X, y, device_params, devices, lr, shards, accumulate, precision)
    train_iter, test_iter = data if data is not None else load_data_fashion_mnist(
        batch_size, data_dir=data_dir, seed=seed, limit_batches=limit_batches)
    if ckpts is not None:
        check_resumable_loader(train_iter, "train")
    _dist.auto_init()
    world, is_root = _dist.world_size(), _dist.rank() == 0
    devices = _local_devices(int(num_gpus))
    if params is None:
        params = lenet_params(seed=seed)
    if world > 1:
        # Every rank starts from rank 0's parameters (copies: the caller's stay untouched).
        params = [p.copyto(p.device) for p in params]
        _dist.broadcast(params, root=0)
    device_params = [get_params(params, d) for d in devices]
    # The schedule sets the lr of an optimizer over the first replica's parameters, which only
    # holds it: the chapter's step updates every replica itself with the lr it is given. The lr
    # checked above goes into its group as a scheduler writes it (the constructor's check would
    # be a second one); the schedules keep it finite and > 0.
    from .optim import SGD
    from .optim.lr_scheduler import make_schedule
    lr_holder = SGD(device_params[0], 1.0)
    lr_holder.param_groups[0]["lr"] = lr
    scheduler = make_schedule(lr_holder, schedule, int(num_epochs),
                              len(train_iter) if schedule != "none" or warmup_epochs else 0,
                              warmup_epochs)
    result = TrainResult(devices=devices, world_size=world)
    config = {"batch_size": batch_size, "num_devices": len(devices), "world_size": world,
              "lr": lr, "seed": seed, "deterministic": shards, "schedule": schedule,
              "warmup_epochs": warmup_epochs, "precision": precision}

    def state():  # collective under mpirun: every rank gathers its losses, rank 0 writes
        return {"params": [p.numpy() for p in device_params[0]],
                "epoch_losses": _gather_losses(loop.run.losses, world),  # (rows, counts)
                "epoch_seen": loop.run.seen}

    loop = Loop("train", "mgpu.train", num_epochs, train_iter, result, ckpts, Timer(), config,
                scheduler, state, log=log, tensorboard=tensorboard, progress=progress,
                plot=plot if plot is not None else in_notebook())
    with loop:  # SIGTERM and SIGUSR1 handled from here (mgpu.loop)
        run = loop.start(resume, lambda path, saved: _resume_lenet(
            path, saved, device_params, train_iter, result, batch_size, len(devices), world,
            is_root, shards, scheduler, precision))
        for epoch in loop.epochs():
            for X, y in train_iter:
                step_lr = lr_holder.lr
                step_losses = step(X, y, device_params, devices, step_lr)
                if scheduler is not None:
                    scheduler.step()
                if step_losses is not None:
                    run.losses.extend(step_losses)
                run.seen += X.shape[0]
                loop.step_done(epoch, step_lr, X.shape[0], step_losses, X.shape[0])
            loop.end_epoch()
            t0 = time.perf_counter()
            result.test_acc.append(evaluate_accuracy(device_params, test_iter, devices))
            result.eval_times.append(time.perf_counter() - t0)
            losses, seen = run.losses, run.seen
            step_losses_host = [host_value(v) for v in losses]
            if check_finite:
                _check_finite_losses(step_losses_host, max(1, len(devices)), epoch, lr)
            loss_sum = sum(step_losses_host)
            if world > 1:
                loss_sum = _sum_over_ranks(loss_sum)
            # A step that reports no losses (the chapter's) leaves the training loss unknown.
            result.train_loss.append(loss_sum / max(1, seen) if losses else float("nan"))
            loop.epoch_done(epoch)
    loop.finish()
    return result


# --- checkpoints (mgpu.checkpoint) ------------------------------------------------------------

def _gather_losses(losses: list, world: int) -> Tuple[np.ndarray, List[int]]:
    """Every rank's step losses of the epoch so far: one zero-padded row per rank and each
    row's length (rows are added across ranks with zeros elsewhere, so every value arrives
    exactly; ranks may hold different counts after a deterministic resume on other ranks)."""
    values = [host_value(v) for v in losses]
    counts = np.zeros(world, dtype=np.float32)  # exact: an epoch has far fewer than 2^24 steps
    counts[_dist.rank()] = len(values)
    if world > 1:
        t = array(counts)
        _dist.allreduce(t)
        counts = t.numpy()
    counts = [int(c) for c in counts]
    rows = np.zeros((world, max(counts, default=0)), dtype=np.float32)
    rows[_dist.rank(), :len(values)] = values
    if world > 1:
        t = array(rows)
        _dist.allreduce(t)
        rows = t.numpy()
    return rows, counts


def _resume_lenet(path: str, state, device_params, train_iter, result: TrainResult,
                  batch_size: int, num_devices: int, world: int, is_root: bool,
                  shards: int, scheduler=None, precision: str = "float32") -> Progress:
    """Puts a checkpoint's state into the run: everything is checked before anything changes."""
    _checkpoint.check_run(path, state, "mgpu.train", batch_size, num_devices, world, shards)
    # Checkpoints from before the precision was recorded come from float32 runs.
    saved_precision = state.get("config", {}).get("precision", "float32")
    if saved_precision != precision:
        raise _checkpoint.CheckpointError(
            path, f"was written by a run with precision={saved_precision!r}, this run has "
            f"precision={precision!r} (the products' rounding), so it would not end with the "
            "uninterrupted run's parameters; resume with the same --precision")
    _checkpoint.check_shapes(path, "parameters", state["params"], device_params[0])
    saved_sched = state.get("scheduler")
    if (saved_sched is None) != (scheduler is None):
        raise _checkpoint.CheckpointError(path, "was written by a run with " + (
            "no learning-rate schedule" if saved_sched is None else "a learning-rate schedule")
            + ", this run has " + ("none" if scheduler is None else "one")
            + "; resume with the same --schedule and --warmup-epochs")
    try:
        rng = _random.generator_from_state(state["rng"])
        if scheduler is not None:
            probe = type(scheduler).__new__(type(scheduler))
            probe.__dict__ = dict(scheduler.__dict__)
            probe.load_state_dict(saved_sched)  # checks before it changes anything
            for v in probe.get_last_lr():  # the lr the run goes on with, as train checks one
                check_lr(v, "train")
    except (ValueError, KeyError, TypeError) as e:
        raise _checkpoint.CheckpointError(path, str(e)) from None
    try:
        rows, counts = state["epoch_losses"]
        saved = [[float(v) for v in row[:int(n)]] for row, n in zip(rows, counts, strict=True)]
    except (TypeError, ValueError, IndexError):
        raise _checkpoint.CheckpointError(path, "its epoch losses are not (rows, counts) with "
                                          "one row per rank (corrupt)") from None
    if len(saved) == world:
        mine = saved[_dist.rank()]
    else:  # deterministic, on another process count: rank 0 carries the epoch's losses so far
        mine = [v for row in saved for v in row] if _dist.rank() == 0 else []
    try:
        train_iter.load_state_dict(state["loader"])  # checks before it changes anything
    except ValueError as e:
        raise _checkpoint.CheckpointError(path, str(e)) from None
    _random.set_generator(rng)
    if scheduler is not None:
        # The lr lives in the optimizer that holds it (as in PyTorch, where the optimizer's state
        # is restored too): it is the lr the schedule's last step set.
        scheduler.load_state_dict(saved_sched)
        for g, v in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            g["lr"] = v
    for ps in device_params:
        for p, v in zip(ps, state["params"]):
            _core.copy(p._t, array(v, device=p.device)._t)
            p._t.bump_version()
    restore_result(result, state["result"])
    if is_root:
        print(f"resuming from {path} (epoch {state['epoch'] + 1}, step {state['step']})")
    return Progress(epoch=int(state["epoch"]), step=int(state["step"]),
                    losses=mine,
                    seen=int(state["epoch_seen"]), elapsed=float(state["epoch_elapsed"]))


def _check_finite_losses(losses: List[float], per_step: int, epoch: int, lr: float) -> None:
    """FloatingPointError at the first step whose loss is not finite (steps count from 1)."""
    for i, value in enumerate(losses):
        if not np.isfinite(value):
            step = i // per_step + 1
            raise FloatingPointError(
                f"train: the loss became {value} at epoch {epoch + 1}, step {step} (lr {lr}); "
                "lower the learning rate, check the data for NaN or infinite values, or pass "
                "check_finite=False (--no-check-finite) to keep training")


def _local_devices(n: int) -> List[Device]:
    """This process's n devices: try_gpu(0..n-1), offset by the local rank when processes share
    a machine's GPUs (CPU devices are per process, so every process counts from cpu(0))."""
    base = _dist.local_rank() * n if _dist.world_size() > 1 and _core.num_gpus() > 0 else 0
    return [try_gpu(base + i) for i in range(n)]


__all__ = ["Timer", "TrainResult", "evaluate_accuracy", "evaluate_accuracy_gpu", "train",
           "DataLoader"]
