"""Beyond one process: data parallelism over MPI, one process per device, on one or many machines.

Start the same program once per device with ``mpirun``::

    mpirun -np 2 python -m mgpu train --batch-size 256      # two processes on this machine
    mpirun -H a,b -np 2 python -m mgpu train ...            # one on machine a, one on b

``init()`` reads the MPI environment (rank, world size, local rank, which chooses this process's
device); outside ``mpirun`` the world is this one process (``world_size() == 1``) and every
collective only checks its arguments. ``train`` and ``train_batch`` call ``init()`` themselves
under ``mpirun``: every rank reads the same shuffled global batch, trains on its slice, starts
from rank 0's parameters, and sums gradients across processes, so the result is the step of one
process with the same global batch.

GPU tensors (the fused step's gradients on GPUs) cross processes on an NCCL communicator over
every rank, one GPU each, its unique id broadcast over MPI, wherever the build has one
(``build_info()['dist_gpu_transport']``; ``MGPU_DIST_GPU=host`` stages them through host memory
over MPI instead); CPU tensors go over MPI. Where this runs: on the CUDA emulator's NCCL (ranks in
several processes meet in shared memory) in the tests; compiled and linked against the toolkit's
NCCL in the real CUDA build, never run on a real GPU by mgpu's tests.

Failures are loud: a collective that waits longer than ``timeout`` seconds (``MGPU_DIST_TIMEOUT``,
default 60) raises ``mgpu.DeviceError`` naming the rank, the collective and the ranks it waits
for; with ``check=True`` (``MGPU_DIST_CHECK=1``) the ranks first compare what they are about to
call (operation, size, dtype, root, sequence number) and all raise at once if they disagree. An
uncaught exception on one rank ends every rank (``MPI_Abort`` at exit), so a job never hangs.
"""
from __future__ import annotations

import atexit
import math
import os
import sys
from typing import Optional, Sequence, Union

from .device import Device, cpu, gpu, num_gpus
from .engine import core as _core
from .tensor import Tensor

_BACKENDS = ("auto", "mpi", "nccl")
_state = {"backend": None, "failed": False, "hooked": False}


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r} must be a finite number > 0 (seconds)")
    return value


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: use 1 or 0")


def launched() -> bool:
    """True when this process was started by ``mpirun`` (or another MPI launcher)."""
    return _core.dist_launched()


def init(backend: str = "auto", timeout: Optional[float] = None, check: Optional[bool] = None,
         algorithm: Optional[str] = None) -> None:
    """Joins the world of processes; call once per process (later calls only check agreement).

    ``backend``: ``"auto"`` uses MPI when started by ``mpirun`` and is a one-process world
    otherwise; ``"mpi"`` requires MPI (a one-process MPI world outside ``mpirun``). Over MPI, GPU
    tensors take the build's transport (``build_info()['dist_gpu_transport']``): an NCCL
    communicator over every rank where the build has one, unless ``MGPU_DIST_GPU=host``, which
    stages them through host memory over MPI. ``"nccl"`` is MPI for the world and for CPU
    tensors and always NCCL for GPU tensors: ``mgpu.DeviceError`` if this build has no MPI back
    end, no CUDA backend or no NCCL, ``ValueError`` with ``MGPU_DIST_GPU=host``.
    ``timeout`` (seconds a collective may wait, env ``MGPU_DIST_TIMEOUT``, default 60),
    ``check`` (compare every collective across ranks first, env ``MGPU_DIST_CHECK``, default
    off) and ``algorithm`` (``"ordered"``: rank-ordered sums, bitwise the in-process result;
    ``"mpi"``: MPI_Allreduce; env ``MGPU_DIST_ALGORITHM``) may be changed at any time later.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"init: backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    if backend == "nccl":
        missing = _nccl_missing()
        if missing:
            raise _core.DeviceError(f"init(backend='nccl'): {missing}")
        if os.environ.get("MGPU_DIST_GPU", "").strip() == "host":
            raise ValueError("init(backend='nccl') puts GPU tensors on NCCL, but "
                             "MGPU_DIST_GPU=host asks to stage them through host memory: unset "
                             "MGPU_DIST_GPU, or use backend='mpi'")
    in_mpirun = launched()
    if backend == "mpi" and not _core.dist_built():
        raise _core.DeviceError("init: this build of mgpu has no MPI back end "
                                f"(build_info()['mpi'] = {_build_mpi()!r}); install Open MPI "
                                "(apt-get install openmpi-bin libopenmpi-dev) and reinstall mgpu")
    if backend == "auto" and in_mpirun and not _core.dist_built():
        raise _core.DeviceError("init: started by mpirun, but this build of mgpu has no MPI back "
                                "end, so every process would train alone; install Open MPI "
                                "(apt-get install openmpi-bin libopenmpi-dev) and reinstall mgpu")
    use_mpi = backend in ("mpi", "nccl") or (backend == "auto" and in_mpirun)
    previous = _state["backend"]
    label = "nccl" if backend == "nccl" else "mpi" if use_mpi else "single"
    if backend == "auto" and use_mpi and previous == "nccl":
        label = previous  # "auto" (train's own call) agrees with an earlier init("nccl")
    if previous is not None and previous != label:
        raise ValueError(f"init: already initialised as {previous!r}; call init once per process")
    # Every setting is read and checked before any is applied: a bad one changes nothing.
    timeout = (float(timeout) if timeout is not None
               else _env_float("MGPU_DIST_TIMEOUT", _core.dist_timeout()))
    check = bool(check) if check is not None else _env_flag("MGPU_DIST_CHECK", _core.dist_check())
    if algorithm is None:
        algorithm = os.environ.get("MGPU_DIST_ALGORITHM", "").strip() or _core.dist_algorithm()
        if algorithm not in ("ordered", "mpi"):
            raise ValueError(f"MGPU_DIST_ALGORITHM={algorithm!r}: use 'ordered' (rank-ordered "
                             "sums, bitwise the in-process result) or 'mpi'")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"init: timeout must be a finite number > 0 (seconds), got {timeout}")
    if algorithm not in ("ordered", "mpi"):
        raise ValueError(f"init: algorithm must be 'ordered' or 'mpi', got {algorithm!r}")
    _core.dist_set_timeout(timeout)
    _core.dist_set_check(check)
    _core.dist_set_algorithm(algorithm)
    _core.dist_init(use_mpi, label == "nccl")
    _state["backend"] = label
    if use_mpi and not _state["hooked"]:
        _state["hooked"] = True
        atexit.register(_finalize_at_exit)
        previous_hook = sys.excepthook

        def _excepthook(kind, value, tb):
            # The traceback first, then (at exit) MPI_Abort: the launcher ends every rank now,
            # instead of peers waiting for this one until their timeout.
            _state["failed"] = True
            previous_hook(kind, value, tb)

        sys.excepthook = _excepthook


def _build_mpi() -> str:
    return str(dict(_core.build_info()).get("mpi"))


def _nccl_missing() -> Optional[str]:
    """Why this build cannot put GPU tensors on NCCL across processes, and how to fix it; None
    when it can."""
    if _core.dist_nccl_world_built():
        return None
    b = dict(_core.build_info())
    use_mpi = "or use backend='mpi' (GPU tensors through host memory)"
    if not _core.dist_built():
        return (f"this build of mgpu has no MPI back end (build_info()['mpi'] = {b['mpi']!r}), "
                "which NCCL across processes bootstraps over; install Open MPI (apt-get install "
                "openmpi-bin libopenmpi-dev) and reinstall mgpu")
    if not (b["cuda_emulation"] or str(b["cuda"]).startswith("built")):
        return (f"this build of mgpu has no CUDA backend (build_info()['cuda'] = {b['cuda']!r}); "
                "install the CUDA toolkit and NCCL and reinstall mgpu, " + use_mpi)
    return (f"this CUDA build of mgpu has no NCCL (build_info()['nccl'] = {b['nccl']!r}); "
            "install NCCL (nccl.h and libnccl, e.g. apt-get install libnccl-dev) and reinstall "
            "mgpu, " + use_mpi)


def auto_init() -> None:
    """What ``train`` and ``train_batch`` call: join the MPI world when started by mpirun."""
    if _state["backend"] is None and launched():
        init("auto")


def is_initialized() -> bool:
    return _core.dist_initialized()


def backend() -> Optional[str]:
    """``"mpi"``, ``"nccl"`` (MPI, GPU tensors on NCCL), ``"single"`` (one process), or ``None``
    before ``init``."""
    return _state["backend"]


def rank() -> int:
    """This process's rank in [0, world_size()); 0 outside mpirun."""
    return _core.dist_rank()


def world_size() -> int:
    """How many processes train together; 1 outside mpirun."""
    return _core.dist_world_size()


def local_rank() -> int:
    """Rank among the processes on this machine (it chooses this process's GPU)."""
    return _core.dist_local_rank()


def local_world_size() -> int:
    """How many processes run on this machine (they share its cores)."""
    return _core.dist_local_size()


def device() -> Device:
    """This process's device: ``gpu(local_rank)`` on a machine with GPUs, else ``cpu(0)``."""
    n = num_gpus()
    return gpu(local_rank() % n) if n else cpu(0)


def _handles(op: str, tensors) -> list:
    items = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    for t in items:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected mgpu tensors, got {type(t).__name__}")
    if not items:
        raise ValueError(f"{op}: got an empty list; pass a tensor or a list of tensors")
    return [t._t for t in items]


def allreduce(tensors: Union[Tensor, Sequence[Tensor]]) -> None:
    """Sums a float32 tensor (or a list, reduced as one buffer) across ranks, in place.

    The tensors live on one device; the work is queued on it in order with the compute, so this
    returns at once (read the result with ``.numpy()``). CPU tensors go over MPI; GPU tensors
    over NCCL or through host memory (see ``init``). Every rank must call it with the same
    shapes, in the same order as its other collectives.
    """
    handles = _handles("allreduce", tensors)
    _core.dist_allreduce(handles)
    for t in handles:  # written in place
        t.bump_version()


def broadcast(tensors: Union[Tensor, Sequence[Tensor]], root: int = 0) -> None:
    """Overwrites every rank's tensors with ``root``'s, in place (any dtype, same shapes)."""
    handles = _handles("broadcast", tensors)
    _core.dist_broadcast(handles, int(root))
    for t in handles:  # written in place
        t.bump_version()


def barrier() -> None:
    """Returns when every rank has called ``barrier`` (and this rank's queued work is done)."""
    _core.dist_barrier(device())


def finalize() -> None:
    """Leaves the world (MPI_Finalize after checking every rank got here); also runs at exit."""
    _core.dist_finalize(False)


def mark_failed() -> None:
    """Makes exit end every rank (MPI_Abort) instead of finalizing: this rank has failed."""
    _state["failed"] = True


def _finalize_at_exit() -> None:
    try:
        _core.dist_finalize(bool(_state["failed"]) and world_size() > 1)
    except Exception as e:  # never let exit hang or raise; the job's exit code tells the story
        print(f"mgpu.distributed: finalize failed on rank {rank()}: {e}", file=sys.stderr)


__all__ = ["init", "launched", "is_initialized", "backend", "rank", "world_size", "local_rank",
           "local_world_size", "device", "barrier", "allreduce", "broadcast", "finalize"]
