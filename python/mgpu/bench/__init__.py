"""Benchmarks behind ``python -m mgpu bench {train,ops,batch_norm,conv,isa,allreduce,checkpoint,
accuracy}``:
plain-dict results (JSON). Every measurement warms up, repeats and keeps each raw time; tables
show the median and the spread ((max - min) / median), because a shared machine is noisy.
"""
from __future__ import annotations

from typing import Dict

from .accuracy import bench_accuracy, format_accuracy
from .allreduce import (
    DEFAULT_SIZES,
    bench_allreduce,
    bus_factor,
    format_allreduce,
    format_size,
    parse_size,
)
from .batch_norm import bench_batch_norm, format_batch_norm
from .checkpoint import bench_checkpoint, format_checkpoint
from .common import (
    SCHEMA,
    lenet_layer_flops,
    lenet_step_flops,
    load,
    machine_info,
    measure,
    module_layer_flops,
    module_step_flops,
    save,
    summarize,
)
from .conv import ALGOS as CONV_ALGOS
from .conv import bench_conv, format_conv
from .isa import bench_isa, format_isa, isa_target
from .ops import bench_ops, format_ops
from .plot import plot
from .rivals import find_jax_python, find_torch_python
from .train import (
    RESNET_PARTS,
    TRAIN_PARTS,
    bench_train,
    bench_train_resnet18,
    format_train,
    resnet18_step_flops,
)


def format_result(r: Dict) -> str:
    """The readable table for any bench result."""
    return {"train": format_train, "ops": format_ops, "batch_norm": format_batch_norm,
            "allreduce": format_allreduce, "checkpoint": format_checkpoint,
            "conv": format_conv, "isa": format_isa,
            "accuracy": format_accuracy}[r["benchmark"]](r)


__all__ = ["bench_accuracy", "bench_train", "bench_train_resnet18", "bench_ops",
           "bench_batch_norm", "bench_conv",
           "bench_isa", "isa_target", "bench_allreduce", "bench_checkpoint", "format_result",
           "plot", "save", "load",
           "summarize", "measure", "machine_info", "lenet_layer_flops", "lenet_step_flops",
           "find_torch_python", "find_jax_python", "bus_factor", "parse_size", "format_size",
           "TRAIN_PARTS",
           "RESNET_PARTS", "module_layer_flops", "module_step_flops", "resnet18_step_flops",
           "DEFAULT_SIZES", "SCHEMA", "CONV_ALGOS"]
