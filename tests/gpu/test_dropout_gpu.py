"""nn.Dropout in the fused step on emulated GPUs: deterministic steps on 1 and 2 GPUs give the
same bits (the masks follow the global batch, not the GPU computing a row), the bucketed step on
2 GPUs (no CUDA graphs: a replayed graph would repeat its masks) stays within float tolerance of
the CPU devices' step, and the mask kernel gives the reference bits (tests/ops covers gpu(0))."""
import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    mgpu.num_gpus() < 2, reason="needs 2 GPUs (the emulated build)")]
GPUS = [mgpu.gpu(0), mgpu.gpu(1)]
CPUS = [mgpu.cpu(0), mgpu.cpu(1)]


def test_deterministic_dropout_steps_give_the_same_bits_on_one_and_two_gpus():
    one = dist_worker.dropout_steps(GPUS[:1], steps=2)
    two = dist_worker.dropout_steps(GPUS, steps=2)
    acc = dist_worker.dropout_steps(GPUS, accumulate=2, steps=2)
    nparams = len(list(dist_worker.dropout_net().parameters()))
    for i, (g, e) in enumerate(zip(two, one)):
        assert np.array_equal(g, e), f"2 GPUs: array {i} differs from 1 GPU"
    for i in range(nparams):
        assert np.array_equal(acc[i], one[i]), f"2 GPUs, accumulate=2: parameter {i} differs"


def test_bucketed_dropout_steps_on_two_gpus_match_two_cpu_devices():
    gpus = dist_worker.dropout_steps(GPUS, shards=False, steps=2)
    cpus = dist_worker.dropout_steps(CPUS, shards=False, steps=2)
    for i, (g, e) in enumerate(zip(gpus, cpus)):
        assert_close(g, e, "sum", f"array {i}: 2 GPUs against 2 CPU devices")
