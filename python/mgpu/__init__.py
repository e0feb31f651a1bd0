"""mgpu: the chapter "Training on Multiple GPUs" as fast software.

Devices (``cpu``, ``gpu``, ``try_gpu``, ``try_all_gpus``), tensors with autograd, the chapters'
ops with their backward passes (``mgpu.ops``), losses and modules (``mgpu.nn``), the networks
(``mgpu.models``), the chapter's helpers (``get_params``, ``allreduce``, ``split_batch``,
``sgd``), a fused data-parallel ``train_batch``, Fashion-MNIST and ``train``. The engine is C++
(``mgpu._core``); every device runs its work asynchronously on its own queue: ops enqueue and
return, and the host waits only where it needs values (``numpy()``, ``item()``, printing,
``waitall()``).

GPUs: ``gpu(i)`` launches onto the GPU's compute stream (and a second stream for communication).
Memory comes from a caching allocator, so a training loop's steady state calls no ``cudaMalloc``
(``gpu_memory_stats(d)``); running out raises ``OutOfMemoryError`` (a ``MemoryError``) naming the
device and the size, and ``empty_cache()`` gives the cache back. A bad label is caught by the
kernel and raised as an ``IndexError`` at the next wait, as on the CPU. ``mgpu info --env`` lists
the switches (``MGPU_GEMM``, ``MGPU_CONV``, ``MGPU_ALLREDUCE``, ...).
"""
import atexit

from . import _startup

_startup.check_cpu()
_startup.preload_blas()
_startup.preload_cuda_wheels()

from . import (  # after the checks above (pyproject.toml: E402 is off for this file)
    _core,
    amp,
    autograd,
    chapter,
    checkpoint,
    data_parallel,
    distributed,
    models,
    nn,
    ops,
    optim,
    plot,
    random,
    trace,
)
from ._core import DeviceError, OutOfMemoryError
from .amp import autocast
from .autograd import no_grad
from .chapter import train_op_by_op
from .checkpoint import CheckpointError, load, save
from .data import DataLoader, get_fashion_mnist_labels, load_data_fashion_mnist
from .device import Device, cpu, gpu, num_gpus, try_all_gpus, try_gpu
from .loop import Preempted
from .models import lenet, lenet_params
from .nn import CrossEntropyLoss, SoftmaxCrossEntropyLoss
from .ops import (
    argmax,
    avg_pool2d,
    batch_norm,
    conv2d,
    cross_entropy,
    dot,
    dropout,
    max_pool2d,
    mm,
    relu,
)
from .parallel import allreduce, get_params, sgd, split_and_load, split_batch, train_batch
from .random import randn
from .tensor import (
    Tensor,
    arange,
    array,
    bfloat16,
    bfloat16_from_bits,
    float32,
    from_dlpack,
    full,
    int32,
    int64,
    ones,
    ones_like,
    tensor,
    uint8,
    zeros,
    zeros_like,
)
from .trace import profile
from .train import Timer, TrainResult, evaluate_accuracy, evaluate_accuracy_gpu, train

__version__: str = _core.build_info()["version"]  # pyproject.toml's, through the build


def _drain_at_exit() -> None:
    # Work still queued at exit would keep running on device threads while the process tears
    # down the libraries it calls (OpenBLAS): finish it first. Errors were the program's to see.
    try:
        _core.waitall()
    except Exception:
        pass


atexit.register(_drain_at_exit)
trace.start_from_env()  # MGPU_TRACE=path: the whole program's timeline, written at exit


def waitall() -> None:
    """Waits until every device has finished its queued work; raises the first error."""
    _core.waitall()


def build_info() -> dict:
    """What this build contains: devices, BLAS, CPU kernel path, CUDA/cuDNN/NCCL/MPI parts."""
    return dict(_core.build_info())


def info(file=None) -> None:
    """Prints what a bug report needs: version, CPU and kernel path, BLAS, CUDA/cuDNN/NCCL/MPI,
    devices, where the data set is. The same as ``python -m mgpu info``."""
    import sys

    from .cli import info_lines
    print("\n".join(info_lines()), file=file or sys.stdout)


def set_num_threads(n: int) -> None:
    """Threads mgpu uses for CPU compute (shared fairly by the busy CPU devices)."""
    from .tensor import check_int
    _core.set_num_threads(check_int(n, "set_num_threads", "n"))


def num_threads() -> int:
    return _core.num_threads()


def gpu_memory_stats(device) -> dict:
    """A GPU's caching allocator in bytes: ``allocated`` (live tensors), ``cached`` (kept for
    reuse), ``peak_allocated``, and ``device_mallocs`` (cudaMalloc calls so far: flat once a
    training loop reaches its steady state)."""
    from .device import as_device
    return dict(_core.gpu_memory_stats(as_device(device)))


def cpu_memory_stats() -> dict:
    """The CPU caching allocator (shared by every CPU device) in bytes: ``allocated`` (live
    tensors), ``cached`` (kept for reuse), ``peak_allocated``, and ``system_mallocs`` /
    ``system_bytes`` (blocks and bytes taken from the system so far: flat once a training loop
    reaches its steady state)."""
    return dict(_core.cpu_memory_stats())


def empty_cache() -> None:
    """Waits for every device, then returns the memory cached by mgpu's allocators."""
    _core.empty_cache()


__all__ = [
    "Device", "DeviceError", "OutOfMemoryError", "Tensor", "CrossEntropyLoss",
    "SoftmaxCrossEntropyLoss", "DataLoader",
    "Timer", "TrainResult", "build_info", "info",
    "cpu", "gpu", "try_gpu", "try_all_gpus", "num_gpus",
    "array", "tensor", "zeros", "ones", "full", "zeros_like", "ones_like", "arange", "randn",
    "from_dlpack", "float32", "bfloat16", "int32", "int64", "uint8", "bfloat16_from_bits",
    "random", "autograd", "chapter", "checkpoint", "data_parallel", "distributed",
    "plot", "no_grad", "amp", "autocast",
    "save", "load", "CheckpointError", "Preempted",
    "models", "nn", "ops", "optim", "profile", "trace",
    "conv2d", "avg_pool2d", "max_pool2d", "dropout", "relu", "batch_norm", "mm", "dot",
    "cross_entropy", "argmax",
    "lenet", "lenet_params", "get_params", "allreduce", "split_batch", "split_and_load", "sgd",
    "train_batch", "load_data_fashion_mnist", "get_fashion_mnist_labels",
    "evaluate_accuracy", "evaluate_accuracy_gpu", "train", "train_op_by_op",
    "waitall", "build_info", "set_num_threads", "num_threads", "gpu_memory_stats",
    "cpu_memory_stats", "empty_cache",
]
