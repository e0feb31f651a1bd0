"""The scaffolding the training loops share: ``mgpu.train`` (sec. 12.5, LeNet) and
``mgpu.chapter.train_concise`` (sec. 12.6, the book's loop and the fused step) each write only
their step, their evaluation and their checkpoint's own contents; the epochs, the timer, the
progress bar and plot, checkpoints and resume, the metrics log, preemption and the finished run's
line are here, written once.

**The metrics log** (``log=PATH``, ``mgpu train --log PATH``): JSON lines, one object per line,
``pandas.read_json(PATH, lines=True)`` reads it. Two kinds of record::

    {"kind": "step", "step": 12, "epoch": 1, "loss": 0.73, "lr": 0.2, "images_per_s": 9800.0,
     "time": 1765000000.1}
    {"kind": "epoch", "step": 235, "epoch": 1, "test_acc": 0.81, "train_loss": 0.95,
     "sec_per_epoch": 3.1, "time": 1765000003.4}

``step`` counts from 1 over the whole run (the checkpoints' step), ``epoch`` from 1; ``loss`` is
the step's mean loss over its global batch; ``lr`` the rate the step used; ``time`` Unix
seconds; an epoch's ``train_loss`` is the loop's own (None where the step reports no loss).
The loops read losses from the devices only where they wait for the devices anyway -- each
epoch's end and each checkpoint -- so the step records are written there, in a batch, and
``images_per_s`` is the throughput over that stretch of steps (between two such points; the
devices' time per step is not known without waiting for every step). Under mpirun rank 0 writes
(the losses summed over the ranks); a run resumed from a checkpoint keeps the records up to the
checkpoint's step and epoch and appends after them, so the log has every step once. A fresh run
starts the file anew.

**TensorBoard** (``tensorboard=DIR``, ``--tensorboard DIR``): the same values as scalars
(``train/loss``, ``train/lr``, ``train/images_per_s`` per step; ``test/acc``,
``train/epoch_loss``, ``time/sec_per_epoch`` per epoch at the epoch's last step) in event files
under DIR, written with the ``tensorboard`` package's own event writer (``pip install
tensorboard``; without it, ImportError saying so). A directory of its own rather than ``log=``
taking a directory: PyTorch's ``SummaryWriter(log_dir)`` and Keras' ``TensorBoard(log_dir)`` name
it so, the two logs can be written together, and a path's meaning never depends on whether it
exists. A resumed run marks its restart step, so TensorBoard drops the events a killed session
wrote past its last checkpoint.

**Preemption**: SIGTERM (a cluster scheduler ending the job) or SIGUSR1 (its warning, e.g. SLURM's
``--signal``) received during a loop lets the current step finish, writes a checkpoint when the
loop has a checkpoint directory, prints one line on rank 0 (the signal, the step, the checkpoint
and how to resume) and raises :class:`Preempted` (the signal, the step, the checkpoint's path);
``resume=True`` (``--resume``) then continues bit for bit. The handlers are installed only while
a loop runs, only from the main thread (elsewhere Python cannot install them, and the signals keep
their previous meaning), and the previous ones are put back after. Under mpirun a signal may
reach one rank only: each step every rank adds its flag into a tiny all-reduce (two floats,
queued behind the step) and reads the previous step's sum, so all ranks stop after the same step,
the one after the signal's step, without the host ever waiting for the step in flight (one
all-reduce of 8 bytes per step, next to the step's own gradient all-reduce; a check only at the
checkpoints would cost nothing per step but could leave a scheduler's grace period waiting for a
whole epoch). A second signal changes nothing; SIGKILL still ends a process at once.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from . import checkpoint as _checkpoint
from . import distributed as _dist
from . import faults
from . import random as _random
from .device import Device
from .engine import core as _core
from .tensor import array

# The signals a loop turns into a checkpointed stop; SIGTERM first where both arrive.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """A training loop stopped on SIGTERM or SIGUSR1 after finishing a step.

    ``signal`` is the signal's number, ``step`` the last step taken (the checkpoint's step),
    ``checkpoint`` the checkpoint file written at that step (None without a checkpoint
    directory). ``exit_status`` is what ``mgpu train`` exits with: 128 + the signal (143 for
    SIGTERM, 138 for SIGUSR1), the status a shell gives a process its signal ended, as the CLI
    gives 130 after Ctrl-C; the line printed and the checkpoint tell a graceful stop from a kill.
    """

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signal = int(signum)
        self.step = int(step)
        self.checkpoint = checkpoint
        self.exit_status = 128 + self.signal
        name = signal.Signals(self.signal).name
        where = (f"checkpoint {checkpoint}; continue with resume=True (mgpu train ... --resume)"
                 if checkpoint else "no checkpoint directory was set (checkpoint=DIR, "
                 "--checkpoint DIR), so nothing was saved to resume from")
        super().__init__(f"{name} received: stopped after step {self.step}; {where}")


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


def progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr)


def in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _sum_over_ranks(values: np.ndarray) -> np.ndarray:
    t = array(np.asarray(values, dtype=np.float32))
    _dist.allreduce(t)
    return t.numpy()


# --- preemption ------------------------------------------------------------------------------

class Preemption:
    """SIGTERM and SIGUSR1 handlers for the time a loop runs (a context manager); ``poll()``
    once per step on every rank says whether to stop now (see the module's docstring)."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict = {}
        self._pending = None  # the all-reduced flags of the previous step, not yet read

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for s in PREEMPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def _handler(self, signum, frame) -> None:
        # Runs between two Python bytecodes of the main thread: only a flag, the loop acts.
        if self.received is None or signum == signal.SIGTERM:
            self.received = signum

    def _flags(self) -> np.ndarray:
        return np.array([self.received == s for s in PREEMPT_SIGNALS], dtype=np.float32)

    @staticmethod
    def _signal_of(flags) -> Optional[int]:
        for s, f in zip(PREEMPT_SIGNALS, flags):
            if f > 0:
                return int(s)
        return None

    def poll(self, world: int) -> Optional[int]:
        """The signal to stop on after this step, the same on every rank, or None."""
        if world == 1:
            return self.received
        stop = None
        if self._pending is not None:  # the previous step's sum: every rank reads the same
            stop = self._signal_of(self._pending.numpy())
            self._pending = None
        if stop is None:
            self._pending = array(self._flags())
            _dist.allreduce(self._pending)
        return stop

    def poll_now(self, world: int) -> Optional[int]:
        """``poll`` where the loop waits anyway (an epoch's end): every rank's flag of this
        moment, summed and read at once, with the previous step's."""
        if world == 1:
            return self.received
        stop = self.poll(world)
        if stop is None and self._pending is not None:
            stop = self._signal_of(self._pending.numpy())
            self._pending = None
        return stop


# --- the metrics log -------------------------------------------------------------------------

def _json_value(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsLog:
    """The run's JSON-lines log and TensorBoard events (see the module's docstring). Step
    records wait in ``pending`` with their loss tensors until ``flush``, at a point where the
    loop waits for the devices anyway; every rank calls ``flush`` (the losses are summed over
    ranks), rank 0 writes."""

    def __init__(self, path, tensorboard, op: str, is_root: bool):
        if path is not None and (isinstance(path, bool) or
                                 not isinstance(path, (str, os.PathLike))):
            raise TypeError(f"{op}: log must be a file path, got {type(path).__name__}")
        if path is not None and os.path.isdir(path):
            raise ValueError(f"{op}: log={os.fspath(path)!r} is a directory; pass a file for "
                             "the JSON lines (TensorBoard's event files go to tensorboard=DIR)")
        self.path = None if path is None else os.fspath(path)
        self.tb_dir = None if tensorboard is None else os.fspath(tensorboard)
        self.op = op
        self.is_root = is_root
        self.pending: list = []  # (step, epoch, lr, batch, losses, divisor, unix time)
        self._file = None
        self._tb = None
        self._window = time.perf_counter()
        if self.tb_dir is not None:
            try:
                from tensorboard.summary.writer.event_file_writer import (  # noqa: F401
                    EventFileWriter,
                )
            except ImportError:
                raise ImportError(f"{op}: tensorboard={self.tb_dir!r} writes TensorBoard event "
                                  "files with the tensorboard package, which is not installed: "
                                  "pip install tensorboard") from None

    def open(self, resumed_step: Optional[int], resumed_epochs: int) -> None:
        """Starts the files: anew for a fresh run; after a resume, the JSON lines up to the
        checkpoint's step and finished epochs are kept (those a killed session wrote later are
        dropped, a torn last line too) and the new ones follow."""
        if not self.is_root:
            return
        if self.path is not None:
            kept = []
            if resumed_step is not None and os.path.exists(self.path):
                with open(self.path) as f:
                    for line in f:
                        try:
                            rec = json.loads(line)
                        except ValueError:
                            continue
                        if not isinstance(rec, dict):
                            continue
                        if rec.get("kind") == "step" and rec.get("step", 1 << 62) <= resumed_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                        elif rec.get("kind") == "epoch" and rec.get("epoch", 1 << 62) \
                                <= resumed_epochs:
                            kept.append(line if line.endswith("\n") else line + "\n")
            tmp = f"{self.path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)
            self._file = open(self.path, "a")
        if self.tb_dir is not None:
            from tensorboard.compat.proto import event_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
            os.makedirs(self.tb_dir, exist_ok=True)
            self._tb = EventFileWriter(self.tb_dir)
            if resumed_step is not None:
                # TensorBoard drops the events past a restart's step (as SummaryWriter's
                # purge_step does): those of a killed session after its last checkpoint.
                self._tb.add_event(event_pb2.Event(
                    step=resumed_step + 1, wall_time=time.time(),
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def restart_window(self) -> None:
        self._window = time.perf_counter()

    def add_step(self, step: int, epoch: int, lr: float, batch: int, losses, divisor) -> None:
        self.pending.append((step, epoch, float(lr), int(batch), list(losses or ()), divisor,
                             time.time()))

    def flush(self, world: int) -> None:
        """Writes the pending step records; the devices have finished their steps (or this
        waits for them)."""
        if not self.pending:
            self.restart_window()
            return
        sums = np.array([sum(host_value(v) for v in p[4]) for p in self.pending], np.float64)
        if world > 1:  # each rank holds its slice's losses: the step's loss is their sum
            sums = _sum_over_ranks(sums.astype(np.float32)).astype(np.float64)
        elapsed = max(time.perf_counter() - self._window, 1e-9)
        rate = sum(p[3] for p in self.pending) / elapsed
        records = []
        for (step, epoch, lr, _, losses, divisor, stamp), total in zip(self.pending, sums):
            loss = float(total) / divisor if losses else None
            records.append({"kind": "step", "step": step, "epoch": epoch, "loss": loss,
                            "lr": lr, "images_per_s": rate, "time": stamp})
        self.pending = []
        self._write(records)
        self.restart_window()

    def add_epoch(self, epoch: int, step: int, test_acc: float, train_loss: float,
                  sec: float) -> None:
        self._write([{"kind": "epoch", "step": step, "epoch": epoch, "test_acc": test_acc,
                      "train_loss": _json_value(train_loss), "sec_per_epoch": sec,
                      "time": time.time()}])

    def _write(self, records: list) -> None:
        if not self.is_root:
            return
        if self._file is not None:
            self._file.write("".join(json.dumps({k: _json_value(v) for k, v in r.items()})
                                     + "\n" for r in records))
            self._file.flush()
        if self._tb is not None:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            tags = {"step": [("train/loss", "loss"), ("train/lr", "lr"),
                             ("train/images_per_s", "images_per_s")],
                    "epoch": [("test/acc", "test_acc"), ("train/epoch_loss", "train_loss"),
                              ("time/sec_per_epoch", "sec_per_epoch")]}
            for r in records:
                values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(r[key]))
                          for tag, key in tags[r["kind"]] if r[key] is not None]
                self._tb.add_event(event_pb2.Event(
                    step=r["step"], wall_time=r["time"],
                    summary=summary_pb2.Summary(value=values)))
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


# --- the loop ----------------------------------------------------------------------------------

class Loop:
    """One training run's scaffolding. A loop builds it, then::

        with loop:                               # SIGTERM / SIGUSR1 handled (main thread)
            run = loop.start(resume, resume_fn)  # a Progress: fresh, or from the checkpoint
            for epoch in loop.epochs():          # the timer and the bar started
                for X, y in train_iter:
                    ...the step...
                    loop.step_done(epoch, lr, X.shape[0], losses, divisor)
                loop.end_epoch()                 # the devices waited for; the epoch's time
                ...evaluation, result.test_acc / train_loss appended...
                loop.epoch_done(epoch)           # log, bar, plot, checkpoint
        loop.finish()                            # the chapter's line

    ``state_fn()`` gives the loop's own part of a checkpoint (parameters or model and optimizer,
    the epoch's losses); the rest (kind, step, epoch, config, data order, RNG, schedule, results,
    the epoch's time so far) is written here.
    """

    def __init__(self, op: str, kind: str, num_epochs: int, train_iter, result: TrainResult,
                 ckpts, timer: Timer, config: dict, scheduler=None,
                 state_fn: Optional[Callable[[], dict]] = None, log=None, tensorboard=None,
                 progress: Optional[bool] = None, plot: bool = False):
        self.op, self.kind, self.num_epochs = op, kind, int(num_epochs)
        self.train_iter, self.result, self.ckpts = train_iter, result, ckpts
        self.timer, self.config, self.scheduler = timer, config, scheduler
        self.state_fn = state_fn
        self.world, self.is_root = _dist.world_size(), _dist.rank() == 0
        self.log = (MetricsLog(log, tensorboard, op, self.is_root)
                    if log is not None or tensorboard is not None else None)
        self.animator = None
        if self.is_root and plot:
            from .plot import Animator
            self.animator = Animator(xlabel="epoch", ylabel="test acc",
                                     xlim=[1, self.num_epochs])
        self.show_bar = self.is_root and (progress if progress is not None
                                          else (sys.stderr.isatty() and self.animator is None))
        self.bar = None
        self.run = Progress()
        self.preemption = Preemption()
        self._saved = (-1, None)  # (step, path) of the checkpoint this session wrote last

    def start(self, resume: bool, resume_fn: Callable) -> Progress:
        """The run's progress: from the newest checkpoint (``resume_fn(path, state)`` checks
        and loads it) or fresh; opens the metrics log where the run stands."""
        resumed = None
        if self.ckpts is not None:
            loaded = self.ckpts.start(resume)
            if loaded is not None:
                self.run = resume_fn(*loaded)
                resumed = self.run.step
                if self.run.epoch >= self.num_epochs and self.is_root:
                    print(f"the run in {self.ckpts.dir} has finished its {self.run.epoch} "
                          "epochs: its results, nothing trained")
        if self.log is not None:
            self.log.open(resumed, self.run.epoch)
        return self.run

    def __enter__(self) -> "Loop":
        self.preemption.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.preemption.__exit__(*exc)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.log is not None:
            self.log.close()

    def epochs(self):
        """The epochs left to train; each starts the bar and the timer."""
        for epoch in range(self.run.epoch, self.num_epochs):
            if self.show_bar:
                self.bar = progress_bar(len(self.train_iter),
                                        f"epoch {epoch + 1}/{self.num_epochs}")
            self.timer.start()
            if self.log is not None:
                self.log.restart_window()
            yield epoch

    def save(self, epoch_next: int) -> Optional[str]:
        """Writes the run's checkpoint (collective under mpirun: every rank calls it)."""
        if self.ckpts is None:
            return None
        _core.waitall()
        run = self.run
        run.losses[:] = [host_value(v) for v in run.losses]
        state = {"kind": self.kind, "step": run.step, "epoch": epoch_next,
                 "config": self.config, "loader": self.train_iter.state_dict(),
                 "rng": _random.get_state(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None
                 else None,
                 "result": result_state(self.result)}
        if self.state_fn is not None:
            state.update(self.state_fn())
        state["epoch_elapsed"] = run.elapsed + self.timer.stop()
        self.timer.times.pop()  # the timer keeps running for the epoch
        path = self.ckpts.write(state, run.step)
        self._saved = (run.step, path)
        return path

    def _sync_point(self, epoch_next: Optional[int]) -> Optional[str]:
        """Log records out, then the checkpoint (when ``epoch_next`` is given)."""
        if self.log is not None:
            self.log.flush(self.world)
        path = self.save(epoch_next) if epoch_next is not None else None
        if self.log is not None:
            self.log.restart_window()  # the next steps' throughput leaves the write out
        return path

    def step_done(self, epoch: int, lr: float, batch: int, losses, divisor) -> None:
        """After a step: counts it, logs it, checkpoints when due, stops when preempted.
        ``losses`` (tensors, read later) over ``divisor`` give the step's mean loss."""
        run = self.run
        run.step += 1
        if self.log is not None:
            self.log.add_step(run.step, epoch + 1, lr, batch, losses, divisor)
        if self.ckpts is not None:
            faults.fault("step")
            if self.ckpts.due(run.step):
                self._sync_point(epoch)
        if self.bar is not None:
            self.bar.update(1)
        signum = self.preemption.poll(self.world)
        if signum is not None:
            self._preempted(signum, epoch)

    def _preempted(self, signum: int, epoch_next: int) -> None:
        step, path = self._saved
        if step != self.run.step:  # not written at this step yet (the log's records too)
            path = self._sync_point(epoch_next if self.ckpts is not None else None)
        stop = Preempted(signum, self.run.step, path)
        if self.is_root:
            print(f"{self.op}: {stop}", file=sys.stderr, flush=True)
        raise stop

    def end_epoch(self) -> None:
        """After the epoch's last step: waits for the devices, records the epoch's time and
        writes the epoch's step records."""
        _core.waitall()
        self.result.epoch_times.append(self.run.elapsed + self.timer.stop())
        if self.log is not None:
            self.log.flush(self.world)

    def epoch_done(self, epoch: int) -> None:
        """After the epoch's evaluation (``result`` holds its figures): the epoch's record,
        bar, plot and checkpoint; a signal received meanwhile stops the run here."""
        r = self.result
        if self.log is not None:
            self.log.add_epoch(epoch + 1, self.run.step, r.test_acc[-1], r.train_loss[-1],
                               r.epoch_times[-1])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{r.train_loss[-1]:.3f}", test_acc=f"{r.test_acc[-1]:.3f}")
            self.bar.close()
            self.bar = None
        if self.animator is not None:
            self.animator.add(epoch + 1, (r.test_acc[-1],))
        self.run.losses, self.run.seen, self.run.elapsed = [], 0, 0.0
        if self.ckpts is not None:
            self.timer.start()
            self.save(epoch + 1)
        if epoch + 1 < self.num_epochs:  # the last epoch's end is the run's: nothing to stop
            signum = self.preemption.poll_now(self.world)
            if signum is not None:
                self._preempted(signum, epoch + 1)

    def finish(self) -> None:
        """The chapter's closing line, on rank 0."""
        if self.is_root:
            print(self.result.summary())


__all__ = ["Preempted", "Timer", "TrainResult", "Loop", "MetricsLog", "PREEMPT_SIGNALS"]
