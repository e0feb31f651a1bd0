"""The chapter's training loop (sec. 12.5.6) and accuracy on all devices (its last exercise).

``train(num_gpus, batch_size, lr)`` loads Fashion-MNIST, replicates LeNet on
``[try_gpu(i) for i in range(num_gpus)]``, runs the fused ``train_batch`` over every minibatch,
evaluates on all devices after each epoch, and prints the chapter's line
``test acc: 0.85, 3.1 sec/epoch on [cpu(0), cpu(1)]``. Under ``mpirun`` the same call trains one
process per device (see ``mgpu.distributed``): same global batches, same step, rank 0 prints.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import _core, faults
from . import checkpoint as _checkpoint
from . import distributed as _dist
from . import random as _random
from . import trace as _trace
from .autograd import no_grad
from .data import DataLoader, load_data_fashion_mnist
from .device import Device, as_device, try_gpu
from .models import lenet_params
from .nn import Module
from .parallel import (
    check_accumulate,
    check_batch_size,
    check_lr,
    evaluate_counts,
    get_params,
    shard_count,
    train_batch,
)
from .tensor import Tensor, array


class Timer:
    """Records elapsed times (d2l's Timer)."""

    def __init__(self):
        self.times: List[float] = []
        self._start = time.perf_counter()

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        self.times.append(time.perf_counter() - self._start)
        return self.times[-1]

    def avg(self) -> float:
        return sum(self.times) / len(self.times) if self.times else 0.0

    def sum(self) -> float:
        return sum(self.times)


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


@dataclass
class TrainResult:
    """What ``train`` measured: one entry per epoch."""
    devices: List[Device]
    world_size: int = 1  # processes that trained together (mgpu.distributed)
    test_acc: List[float] = field(default_factory=list)
    train_loss: List[float] = field(default_factory=list)
    epoch_times: List[float] = field(default_factory=list)
    eval_times: List[float] = field(default_factory=list)

    @property
    def sec_per_epoch(self) -> float:
        return float(np.mean(self.epoch_times)) if self.epoch_times else 0.0

    def summary(self) -> str:
        """The chapter's closing line."""
        procs = f" x {self.world_size} processes" if self.world_size > 1 else ""
        return (f"test acc: {self.test_acc[-1]:.2f}, {self.sec_per_epoch:.1f} sec/epoch "
                f"on {self.devices}{procs}")


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def train(num_gpus: int, batch_size: int, lr: float, num_epochs: int = 10,
          data_dir: Optional[str] = None, limit_batches: Optional[int] = None, seed: int = 0,
          params: Optional[Sequence[Tensor]] = None, progress: Optional[bool] = None,
          plot: Optional[bool] = None, data=None, step: Optional[Callable] = None,
          check_finite: bool = True, deterministic=False, checkpoint: Optional[str] = None,
          checkpoint_every: Optional[int] = None, resume: bool = False,
          schedule: str = "none", warmup_epochs: int = 0, accumulate: int = 1) -> TrainResult:
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
    if accumulate != 1 and step is not None:
        raise ValueError("train: accumulate is a mode of the fused train_batch; the chapter's "
                         "op-by-op step takes the whole batch (drop accumulate or step)")
    if step is None:
        def step(X, y, device_params, devices, lr):
            return train_batch(X, y, device_params, devices, lr, deterministic=shards or False,
                               accumulate=accumulate)
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
    # holds it: the chapter's step updates every replica itself with the lr it is given.
    from .optim import SGD
    from .optim.lr_scheduler import make_schedule
    lr_holder = SGD(device_params[0], lr)
    scheduler = make_schedule(lr_holder, schedule, int(num_epochs),
                              len(train_iter) if schedule != "none" or warmup_epochs else 0,
                              warmup_epochs)
    result = TrainResult(devices=devices, world_size=world)
    run = Progress()
    if ckpts is not None:
        loaded = ckpts.start(resume)
        if loaded is not None:
            run = _resume_lenet(*loaded, device_params, train_iter, result, batch_size,
                                len(devices), world, is_root, shards, scheduler)
    animator = None
    if is_root and (plot if plot is not None else _in_notebook()):
        from .plot import Animator
        animator = Animator(xlabel="epoch", ylabel="test acc", xlim=[1, num_epochs])
    show_bar = is_root and (progress if progress is not None
                            else (sys.stderr.isatty() and animator is None))
    timer = Timer()
    config = {"batch_size": batch_size, "num_devices": len(devices), "world_size": world,
              "lr": lr, "seed": seed, "deterministic": shards, "schedule": schedule,
              "warmup_epochs": warmup_epochs}

    def save_state(epoch_next: int) -> None:
        # Collective under mpirun: every rank gathers its losses, rank 0 writes.
        _core.waitall()
        state = {"kind": "mgpu.train", "step": run.step, "epoch": epoch_next, "config": config,
                 "params": [p.numpy() for p in device_params[0]],
                 "loader": train_iter.state_dict(), "rng": _random.get_state(),
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "result": result_state(result),
                 "epoch_losses": _gather_losses(run.losses, world),  # (rows, counts)
                 "epoch_seen": run.seen, "epoch_elapsed": run.elapsed + timer.stop()}
        timer.times.pop()  # the timer keeps running for the epoch
        ckpts.write(state, run.step)

    for epoch in range(run.epoch, int(num_epochs)):
        title = f"epoch {epoch + 1}/{num_epochs}"
        bar = progress_bar(len(train_iter), title) if show_bar else None
        timer.start()
        for X, y in train_iter:
            step_losses = step(X, y, device_params, devices, lr_holder.lr)
            if scheduler is not None:
                scheduler.step()
            if step_losses is not None:
                run.losses.extend(step_losses)
            run.seen += X.shape[0]
            run.step += 1
            if ckpts is not None:
                faults.fault("step")
                if ckpts.due(run.step):
                    run.losses[:] = [host_value(v) for v in run.losses]
                    save_state(epoch)
            if bar is not None:
                bar.update(1)
        _core.waitall()
        result.epoch_times.append(run.elapsed + timer.stop())
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
        if bar is not None:
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}",
                            test_acc=f"{result.test_acc[-1]:.3f}")
            bar.close()
        if animator is not None:
            animator.add(epoch + 1, (result.test_acc[-1],))
        run.losses, run.seen, run.elapsed = [], 0, 0.0
        if ckpts is not None:
            timer.start()
            save_state(epoch + 1)
    if is_root:
        print(result.summary())
    return result


# --- checkpoints (mgpu.checkpoint) ------------------------------------------------------------

@dataclass
class Progress:
    """Where a run is: the epoch under way, steps taken, and the epoch's partial results."""
    epoch: int = 0
    step: int = 0
    losses: list = field(default_factory=list)  # the epoch's step losses (tensors or floats)
    seen: int = 0
    elapsed: float = 0.0  # seconds of the epoch spent before the run was resumed


def host_value(v) -> float:
    return v if isinstance(v, float) else v.item()


def open_checkpoints(checkpoint, every, resume, op: str):
    """The run's checkpoint directory, or None; ValueError for options that need one."""
    if checkpoint is None:
        if resume or every is not None:
            raise ValueError(f"{op}: resume and checkpoint_every need checkpoint=DIR (the "
                             "directory of the run's checkpoints)")
        return None
    return _checkpoint.TrainCheckpoints(checkpoint, every, op)


def check_resumable_loader(train_iter, op: str) -> None:
    if not (hasattr(train_iter, "state_dict") and hasattr(train_iter, "load_state_dict")):
        raise TypeError(f"{op}: checkpoints save the training data's order and position, so the "
                        "training iterator must be an mgpu DataLoader (load_data_fashion_mnist, "
                        f"mgpu.data.array_loader), got {type(train_iter).__name__}")


def result_state(result: TrainResult) -> dict:
    return {"test_acc": list(result.test_acc), "train_loss": list(result.train_loss),
            "epoch_times": list(result.epoch_times), "eval_times": list(result.eval_times)}


def restore_result(result: TrainResult, saved: dict) -> None:
    for name in ("test_acc", "train_loss", "epoch_times", "eval_times"):
        getattr(result, name)[:] = [float(v) for v in saved[name]]


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
                  shards: int, scheduler=None) -> Progress:
    """Puts a checkpoint's state into the run: everything is checked before anything changes."""
    _checkpoint.check_run(path, state, "mgpu.train", batch_size, num_devices, world, shards)
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


def progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr)


__all__ = ["Timer", "TrainResult", "evaluate_accuracy", "evaluate_accuracy_gpu", "train",
           "DataLoader"]
