"""nn.Dropout in the fused step on emulated GPUs: one step on 2 GPUs against the float64 step
with the reference masks (the global batch's), deterministic steps on 1 and 2 GPUs giving the
same bits, and the bucketed step on 2 GPUs (no CUDA graphs: a replayed graph would repeat its
masks) within float tolerance of the CPU devices' step. The mask kernel's bits on gpu(0):
tests/ops/test_dropout_mask.py."""
import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close
from test_fused_dropout import check_step_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    mgpu.num_gpus() < 2, reason="needs 2 GPUs (the emulated build)")]
CPUS = [mgpu.cpu(0), mgpu.cpu(1)]


@pytest.fixture
def gpus():
    """gpu(0) and gpu(1), made when a test runs (collection must not need a GPU)."""
    return [mgpu.gpu(0), mgpu.gpu(1)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_one_step_on_two_gpus_matches_the_float64_step_with_the_reference_masks(gpus,
                                                                                  deterministic):
    check_step_against_reference(gpus, 1, deterministic)


def test_deterministic_dropout_steps_give_the_same_bits_on_one_and_two_gpus(gpus):
    one = dist_worker.dropout_steps(gpus[:1], steps=2)
    two = dist_worker.dropout_steps(gpus, steps=2)
    acc = dist_worker.dropout_steps(gpus, accumulate=2, steps=2)
    nparams = len(list(dist_worker.dropout_net().parameters()))
    for i, (g, e) in enumerate(zip(two, one)):
        assert np.array_equal(g, e), f"2 GPUs: array {i} differs from 1 GPU"
    for i in range(nparams):
        assert np.array_equal(acc[i], one[i]), f"2 GPUs, accumulate=2: parameter {i} differs"


def test_bucketed_dropout_steps_on_two_gpus_match_two_cpu_devices(gpus):
    gpus = dist_worker.dropout_steps(gpus, shards=False, steps=2)
    cpus = dist_worker.dropout_steps(CPUS, shards=False, steps=2)
    for i, (g, e) in enumerate(zip(gpus, cpus)):
        assert_close(g, e, "sum", f"array {i}: 2 GPUs against 2 CPU devices")
